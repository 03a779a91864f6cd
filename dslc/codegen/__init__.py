"""The second backend: checked IR -> a readable, standalone Python module (jinja2 templates).

Imports no jax: generating code is as quick as checking.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dslc.codegen.render import MARKER, generate
from dslc.frontend import CompileError, MeshArg, analyze


def generate_module(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Sequence[str] | Mapping[str, int] | None = None,
    schedule: str | None = None,
) -> str:
    """The standalone module for a spec (text or path) on a mesh; raises CompileError with
    the diagnostics when the spec does not check."""
    analysis = analyze(source_or_path, mesh, overrides, schedule)
    if not analysis.ok or analysis.program is None or analysis.source is None:
        raise CompileError(analysis)
    program = analysis.program
    return generate(program, analysis.source.text, analysis.source.name, "x".join(map(str, program.mesh.shape)))


__all__ = ["MARKER", "generate", "generate_module"]
