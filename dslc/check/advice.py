"""Warnings: the plan is legal but will waste time or memory."""

from __future__ import annotations

import math

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.ir.nodes import Program, StackedWeight, counted_layers, stacked_weights
from dslc.ir.schedule import pipeline_figures, stage_of
from dslc.schedules import ScheduleError

MIN_EFFICIENCY = 0.80
MAX_IMBALANCE = 0.10
# A weight this large kept whole on every device is worth a second look.
LARGE_TENSOR_BYTES = 16 * 1024 * 1024


def check_efficiency(program: Program, diags: Diagnostics) -> None:
    p = program.pipeline
    stages = program.stages
    if p is None or stages < 2:
        return
    try:
        figures = pipeline_figures(program)
    except ScheduleError:
        return  # check_schedule reported it
    assert figures is not None
    efficiency = 1.0 - figures.bubble_fraction
    if efficiency >= MIN_EFFICIENCY:
        return
    # For GPipe and 1F1B the bubble is (P-1)/(M+P-1); M >= 4(P-1) keeps it at or under 20%.
    enough = 4 * (stages - 1)
    diags.warning(
        "W001",
        f"pipeline efficiency is {efficiency:.0%}: with {stages} stages and {p.microbatches} microbatches, "
        f"{figures.bubble_fraction:.0%} of the {p.schedule} schedule is bubble",
        p.span,
        notes=[f"efficiency under {MIN_EFFICIENCY:.0%} wastes devices waiting on each other"],
        help=f"use at least {enough} microbatches (or an interleaved schedule)",
    )


def check_balance(program: Program, diags: Diagnostics) -> None:
    p = program.pipeline
    stages = program.stages
    if p is None or stages < 2 or not program.chunks:
        return
    try:
        stage = stage_of(program)
    except ScheduleError:
        return  # check_schedule reported it
    flops = [0] * stages
    for chunk in program.chunks:
        flops[stage[chunk.index]] += sum(layer.flops * times for layer, times in counted_layers(chunk.nodes))
    heavy = max(range(stages), key=flops.__getitem__)
    light = min(range(stages), key=flops.__getitem__)
    if flops[heavy] <= (1 + MAX_IMBALANCE) * flops[light]:
        return
    notes = ["forward FLOPs per stage: " + ", ".join(f"{i}: {f:.3g}" for i, f in enumerate(flops))]
    if p.virtual == 1:
        fix = "the slowest stage sets the pace; move layers from the heavy stage or balance with `stage { }` blocks"
    else:
        chunks = [c.index for c in program.chunks if stage[c.index] == heavy]
        notes.append(f"stage {heavy} runs chunks {', '.join(map(str, chunks))} ({p.virtual} per stage)")
        fix = (
            f"the slowest stage sets the pace; move layers off stage {heavy}'s chunks (layers before or after "
            "a `stages { }` region run in its first or its last chunk)"
        )
    diags.warning(
        "W002",
        f"pipeline stages are unbalanced: {_imbalance(heavy, flops[heavy], light, flops[light])}",
        p.span,
        labels=_stage_starts(program, heavy),
        notes=notes,
        help=fix,
    )


def _stage_starts(program: Program, stage: int) -> list[Label]:
    """Where the stage's chunks begin, where that place is its own: a `repeat` cut into
    several chunks is one line for all of them, and says nothing about this stage."""
    others = {c.span for c in program.chunks if c.stage != stage}
    virtual = program.pipeline is not None and program.pipeline.virtual > 1
    labels: dict[Span, Label] = {}
    for c in program.chunks:
        if c.stage == stage and c.span not in others and c.span not in labels:
            what = f"chunk {c.index} (stage {stage})" if virtual else f"stage {stage}"
            labels[c.span] = Label(c.span, f"{what} starts here")
    return list(labels.values())


def _imbalance(heavy: int, heavy_flops: int, light: int, light_flops: int) -> str:
    """How much more the heavy stage does than the light one, relative to the light one."""
    if light_flops == 0:
        return f"stage {light} does no work at all, stage {heavy} does {heavy_flops:.3g} FLOPs"
    if heavy_flops >= 2 * light_flops:
        ratio = heavy_flops / light_flops
        return (
            f"stage {heavy} does {ratio:.1f}x the work of stage {light}"
            if ratio < 10
            else (f"stage {heavy} does {ratio:,.0f}x the work of stage {light}")
        )
    return f"stage {heavy} does {(heavy_flops - light_flops) / light_flops:.0%} more work than stage {light}"


def check_replication(program: Program, diags: Diagnostics) -> None:
    mesh = program.mesh
    holders = mesh.devices // program.stages
    if holders < 2 or program.train.zero >= 3:
        return
    # Grouped by where the weights were written: an unsharded layer's weights all carry its
    # call's span, and a block's line is shared by all its uses; one warning per place.
    found: dict[Span, list[StackedWeight]] = {}
    uses: dict[Span, set[str]] = {}
    for sw in stacked_weights(program.nodes):
        w = sw.weight
        # A tied weight is reported where the weight it reads was written.
        if w.tie is not None or w.type.axes_used or w.type.nbytes < LARGE_TENSOR_BYTES:
            continue
        uses.setdefault(w.span, set()).add(sw.layer.path)
        if len(uses[w.span]) == 1 and all(other.name != sw.name for other in found.get(w.span, [])):
            found.setdefault(w.span, []).append(sw)
    for span, weights in found.items():
        more = len(uses[span]) - 1
        also = f" (and {more} more uses of this line)" if more else ""
        total = sum(w.weight.type.nbytes * math.prod(w.lengths) for w in weights)
        if len(weights) == 1:
            t = weights[0].weight.type
            layers = f"{math.prod(weights[0].lengths)} x " if weights[0].repeats else ""
            what = f"`{weights[0].name}` {layers}{t.describe()} ({total / 2**20:.0f} MiB) is"
        else:
            what = f"{', '.join(f'`{w.name}`' for w in weights)} ({total / 2**20:.0f} MiB in all) are"
        diags.warning(
            "W003",
            f"{what} replicated on all {holders} devices that hold {'it' if len(weights) == 1 else 'them'}{also}",
            span,
            help=f"shard one of {'its' if len(weights) == 1 else 'their'} dimensions over a mesh axis, "
            "or shard parameters with `zero 3` / `fsdp`",
        )
