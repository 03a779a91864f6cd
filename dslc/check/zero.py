"""ZeRO / FSDP: every array it should split must be splittable, or the user hears of it."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics, Span
from dslc.ir.nodes import Program
from dslc.ir.placement import place
from dslc.ir.state import gathered_weights_kept, zero_axes

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
    # call's span.
    stuck: dict[Span, list[str]] = {}
    for array in place(program).arrays:
        if not array.state(program).spread_ok:
            stuck.setdefault(array.span, []).append(f"`{array.name}` {array.type.describe()}")
    for span, names in stuck.items():
        diags.warning(
            "W004",
            f"ZeRO stage {zero} cannot split the {_WHAT[zero]} of {', '.join(names)} "
            f"over {', '.join(axes)} (size {program.mesh.size(axes)}): "
            f"no dimension divides evenly, so {'it stays' if len(names) == 1 else 'they stay'} as declared",
            span,
            help="make one dimension divisible by the data-parallel size",
        )
    kept = gathered_weights_kept(program)
    if kept:
        mib = kept / 2**20
        diags.warning(
            "W004",
            f"ZeRO stage 3 splits the parameters, but the backward pass keeps {mib:,.2f} MiB per device of them "
            "gathered: those of every layer no checkpoint reruns, at the sharding they compute with",
            program.train.span,
            help="checkpoint the repeated blocks (`block NAME(...) checkpoint full`, or `selective`): their "
            "backward then gathers each layer's weights again, one layer at a time",
        )
