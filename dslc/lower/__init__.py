"""Lowering: a checked spec to jitted, sharded JAX on a device mesh, by running the module the
code generator writes for it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dslc.codegen import module_for
from dslc.frontend import CompileError, MeshArg, Overrides, analyze
from dslc.lower.devices import request_host_devices

if TYPE_CHECKING:
    from dslc.lower.program import Program


def compile(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Overrides = None,
    schedule: str | None = None,
) -> Program:
    """Check a spec and bind it to a mesh ("2x4x2", sizes in the spec's axis order; the
    spec's defaults when None). `overrides` sets constants; `schedule` replaces the
    spec's pipeline schedule. Raises CompileError carrying the diagnostics."""
    analysis = analyze(source_or_path, mesh, overrides, schedule)
    if not analysis.ok:
        raise CompileError(analysis)
    program = analysis.program
    assert program is not None
    text = module_for(analysis)
    # Before anything imports jax: a CPU-only machine simulates the mesh on host devices.
    request_host_devices(program.mesh.devices)
    from dslc.lower.devices import make_mesh
    from dslc.lower.program import Program

    return Program(program, make_mesh(program.mesh), text)


__all__ = ["CompileError", "compile"]
