"""The batch must split into accumulation steps, pipeline microbatches and data shards."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics, Label
from dslc.ir.nodes import Program
from dslc.ir.shardings import divisor_sizes


def check_batch(program: Program, diags: Diagnostics) -> None:
    stream = program.input(program.stream)
    if stream.type.rank == 0:
        diags.error("E016", f"input `{stream.name}` has no batch dimension", stream.span)
        return
    batch = stream.type.shape[0]
    for other in program.inputs:
        if other.name != stream.name and other.type.rank and other.type.shape[0] != batch:
            diags.error(
                "E016",
                f"input `{other.name}` has batch size {other.type.shape[0]}, but `{stream.name}` has {batch}",
                other.span,
                labels=[Label(stream.span, f"batch size {batch} declared here")],
            )
    dp_axes = stream.type.sharding[0]
    dp = program.mesh.size(dp_axes)
    micro = program.pipeline.microbatches if program.pipeline else 1
    accumulate = program.train.accumulate
    pieces = dp * micro * accumulate
    if batch % pieces == 0:
        return
    parts = []
    labels = []
    if accumulate > 1:
        parts.append(f"{accumulate} accumulation steps")
        labels.append(Label(program.train.span, f"accumulate {accumulate}"))
    if program.pipeline:
        parts.append(f"{micro} microbatches")
        labels.append(Label(program.pipeline.span, f"microbatches {micro}"))
    parts.append(f"{dp} data-parallel shards")
    works = [d for d in divisor_sizes(batch // dp if batch % dp == 0 else batch) if d <= 256]
    diags.error(
        "E020",
        f"batch size {batch} cannot be split into {' x '.join(parts)} (= {pieces})",
        stream.span,
        labels=labels,
        notes=[
            f"{batch} / {dp} data shards = {batch / dp:g} per shard, "
            f"which splits evenly into {', '.join(map(str, works))}"
        ]
        if batch % dp == 0
        else [],
        help="choose microbatches (and accumulation steps) whose product divides the per-shard batch",
    )
