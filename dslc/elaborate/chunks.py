"""Assign pipeline chunks: the forward body cut into the chunks the pipeline runs, each on
the stage its schedule places it."""

from __future__ import annotations

from dataclasses import replace

from dslc.diagnostics import NO_SPAN, Diagnostics, Label
from dslc.elaborate.flow import Segment
from dslc.ir import nodes as ir
from dslc.ir.schedule import resolved
from dslc.ir.shardings import divisor_sizes
from dslc.schedules import ScheduleError


def assign_chunks(
    segments: list[Segment],
    pipeline: ir.Pipeline | None,
    mesh: ir.Mesh,
    diags: Diagnostics,
    misplaced_stages: bool = False,
) -> tuple[ir.Chunk, ...]:
    """The chunks of the body's `segments`: one without a pipeline; else as many as the
    pipeline's stages times its virtual count, cut where `stage` blocks are written or evenly
    through the `stages` region. None at all after reporting why they cannot be cut;
    `misplaced_stages` says a `stage` written below the top was reported already."""
    marked = [s for s in segments if s.kind != "loose"]
    if pipeline is None:
        for s in marked:
            diags.error(
                "E028",
                f"`{s.kind}` marks pipeline chunks, but the spec declares no pipeline",
                s.span,
                help="add `pipeline AXIS { schedule 1f1b  microbatches N }`",
            )
        return (ir.Chunk(0, 0, 0, tuple(n for s in segments for n in s.nodes)),)
    stages = mesh.size((pipeline.axis,))
    kinds = {s.kind for s in marked}
    groups: list[list[ir.Node]] | None
    if kinds == {"stage", "stages"}:
        diags.error("E028", "use either `stage { }` blocks or one `stages { }` region, not both", marked[0].span)
        return ()
    if kinds == {"stages"}:
        groups = _split_region(segments, marked, pipeline, stages, diags)
    elif kinds == {"stage"}:
        groups = _stage_blocks(segments, marked, pipeline, stages, diags)
    else:
        groups = _unmarked(segments, pipeline, stages, diags, misplaced_stages)
    if groups is None:
        return ()
    stage = _placement(pipeline, stages, len(groups))
    return tuple(
        ir.Chunk(i, stage[i], stage[:i].count(stage[i]), tuple(g), g[0].span if g else NO_SPAN)
        for i, g in enumerate(groups)
    )


def _split_region(
    segments: list[Segment], marked: list[Segment], pipeline: ir.Pipeline, stages: int, diags: Diagnostics
) -> list[list[ir.Node]] | None:
    """The chunks of one `stages` region, split evenly; what comes before it joins the first
    chunk, what comes after the last."""
    wanted = stages * pipeline.virtual
    if len(marked) > 1:
        diags.error(
            "E028",
            "a forward body has at most one `stages { }` region",
            marked[1].span,
            labels=[Label(marked[0].span, "first region")],
        )
        return None
    region = marked[0]
    # A repeat is as many units as it has copies; the others are one each.
    units = sum(n.count if isinstance(n, ir.Repeat) else 1 for n in region.nodes)
    if not units or units % wanted:
        counts = divisor_sizes(units) if units else []
        diags.error(
            "E019",
            f"{units} layers cannot be split evenly into {wanted} pipeline chunks "
            f"({stages} stages x {pipeline.virtual} virtual)",
            region.span,
            labels=[Label(pipeline.span, "pipeline declared here")],
            notes=[f"{units} layers split evenly into {', '.join(map(str, counts))} chunks"] if counts else [],
            help="change the repeat count, the pipeline axis size in --mesh, or `virtual`",
        )
        return None
    groups = _split_evenly(region.nodes, units // wanted)
    groups[0][:0] = [n for s in segments[: segments.index(region)] for n in s.nodes]
    groups[-1].extend(n for s in segments[segments.index(region) + 1 :] for n in s.nodes)
    return groups


def _stage_blocks(
    segments: list[Segment], marked: list[Segment], pipeline: ir.Pipeline, stages: int, diags: Diagnostics
) -> list[list[ir.Node]] | None:
    """One chunk per `stage` block written; what comes before the first joins it, and loose
    layers after a stage join that stage."""
    wanted = stages * pipeline.virtual
    if len(marked) != wanted:
        diags.error(
            "E018",
            f"the spec writes {len(marked)} stages, but the pipeline axis `{pipeline.axis}` has size "
            f"{stages} and `virtual` is {pipeline.virtual}, which makes {wanted} chunks",
            marked[0].span,
            labels=[Label(pipeline.span, "pipeline declared here")],
            help=f"write {wanted} `stage` blocks, or pass a --mesh whose `{pipeline.axis}` size "
            f"times `virtual` is {len(marked)}",
        )
        return None
    groups = [list(s.nodes) for s in marked]
    first = segments.index(marked[0])
    # Loose layers after a stage belong to the stage before them.
    g = -1
    for s in segments[first:]:
        if s.kind == "stage":
            g += 1
        else:
            groups[g].extend(s.nodes)
    groups[0][:0] = [n for s in segments[:first] for n in s.nodes]
    return groups


def _unmarked(
    segments: list[Segment], pipeline: ir.Pipeline, stages: int, diags: Diagnostics, misplaced_stages: bool
) -> list[list[ir.Node]] | None:
    """The one chunk of a body that marks no stages, under a pipeline of one chunk."""
    if stages * pipeline.virtual > 1:
        # A `stage` written inside a block or residual was already reported; saying the body
        # marks no stages would only repeat that mistake.
        if not misplaced_stages:
            diags.error(
                "E018",
                f"the pipeline axis `{pipeline.axis}` has size {stages} (x {pipeline.virtual} virtual), "
                "but the forward body marks no stages",
                pipeline.span,
                help="wrap the repeated layers in `stages { }`, or write `stage { }` blocks",
            )
        return None
    return [[n for s in segments for n in s.nodes]]


def _placement(pipeline: ir.Pipeline, stages: int, chunks: int) -> tuple[int, ...]:
    """The stage that holds each chunk, as the schedule places it (chunk c on stage c mod P
    but in a V); where the schedule cannot say (its own mistake, reported by the checker),
    the ring's."""
    try:
        found = resolved(pipeline, stages).placement()
    except ScheduleError:
        found = ()
    return found if len(found) == chunks else tuple(i % stages for i in range(chunks))


def _split_evenly(nodes: list[ir.Node], per: int) -> list[list[ir.Node]]:
    """Cut a run of nodes into groups of `per` units each, a repeat counting one unit per copy:
    a repeat that straddles a cut is shared, each group running its own copies of it."""
    groups: list[list[ir.Node]] = [[]]
    room = per
    for node in nodes:
        if not isinstance(node, ir.Repeat):
            if not room:
                groups.append([])
                room = per
            groups[-1].append(node)
            room -= 1
            continue
        done = 0
        while done < node.count:
            if not room:
                groups.append([])
                room = per
            take = min(room, node.count - done)
            groups[-1].append(replace(node, count=take, first=node.first + done, total=node.length))
            done += take
            room -= take
    return groups
