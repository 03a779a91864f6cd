"""ZeRO / FSDP: every tensor it should split must be splittable, or the user hears of it."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics
from dslc.ir.nodes import Program, all_layers
from dslc.ir.state import state_sharding, zero_axes

_WHAT = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer state"}


def check_zero(program: Program, diags: Diagnostics) -> None:
    zero = program.train.zero
    axes = zero_axes(program)
    if not zero:
        return
    if not axes or program.mesh.size(axes) == 1:
        if not axes:
            diags.warning(
                "W004",
                f"ZeRO stage {zero} has no data-parallel axis to shard over: the batch is not split",
                program.train.span,
                help="split the input's batch dimension over a mesh axis, or name axes with `fsdp AXIS`",
            )
        return
    for layer in all_layers(program):
        for w in layer.weights:
            if not state_sharding(w.type, program).spread_ok:
                diags.warning(
                    "W004",
                    f"ZeRO stage {zero} cannot split the {_WHAT[zero]} of `{layer.path}.{w.name}` "
                    f"{w.type.describe()} over {', '.join(axes)} (size {program.mesh.size(axes)}): "
                    "no dimension divides evenly, so it stays as declared",
                    w.span,
                    help="make one dimension divisible by the data-parallel size",
                )
