"""The one backend: checked IR -> a readable, standalone Python module (jinja2 templates),
which `dslc compile` writes and `Program` (dslc.lower) loads and runs.

Imports no jax: generating code is as quick as checking.
"""

from __future__ import annotations

import os

from dslc.codegen.render import MARKER, generate
from dslc.frontend import Analysis, CompileError, MeshArg, Overrides, analyze


def generate_module(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Overrides = None,
    schedule: str | None = None,
) -> str:
    """The standalone module for a spec (text or path) on a mesh; raises CompileError with
    the diagnostics when the spec does not check."""
    analysis = analyze(source_or_path, mesh, overrides, schedule)
    if not analysis.ok:
        raise CompileError(analysis)
    return module_for(analysis)


def module_for(analysis: Analysis, regenerate: tuple[str, str] | None = None) -> str:
    """The module for a spec that checked clean; `regenerate` is (the command that wrote
    it, the file it wrote)."""
    assert analysis.program is not None and analysis.source is not None
    program = analysis.program
    mesh_size = "x".join(map(str, program.mesh.shape))
    return generate(program, analysis.source.text, analysis.source.name, mesh_size, regenerate)


__all__ = ["MARKER", "generate", "generate_module", "module_for"]
