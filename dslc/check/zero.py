"""ZeRO / FSDP: every tensor it should split must be splittable, or the user hears of it."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics, Span
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
    # One warning per place the weights were written: an unsharded layer's weights share its
    # call's span, and a block's line is shared by all its uses (the first use is named).
    stuck: dict[Span, list[str]] = {}
    named_by: dict[Span, str] = {}
    for layer in all_layers(program):
        for w in layer.weights:
            if not state_sharding(w.type, program).spread_ok and named_by.setdefault(w.span, layer.path) == layer.path:
                stuck.setdefault(w.span, []).append(f"`{layer.path}.{w.name}` {w.type.describe()}")
    for span, names in stuck.items():
        diags.warning(
            "W004",
            f"ZeRO stage {zero} cannot split the {_WHAT[zero]} of {', '.join(names)} "
            f"over {', '.join(axes)} (size {program.mesh.size(axes)}): "
            f"no dimension divides evenly, so {'it stays' if len(names) == 1 else 'they stay'} as declared",
            span,
            help="make one dimension divisible by the data-parallel size",
        )
