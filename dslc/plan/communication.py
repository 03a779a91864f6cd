"""Bytes each device sends per training step, by collective kind, mesh axes and phase.

Sizes use the standard ring algorithms over a group of N devices, S being the bytes of the
whole tensor the group works on (the collective's elements over the group's share of the
batch): all-reduce sends 2(N-1)/N·S per device, all-gather and reduce-scatter (N-1)/N·S,
all-to-all (N-1)/N of its local S/N, a collective-permute (one pass of a ring, or one
reordering of the pieces) its own piece S/N, and a pipeline send (ppermute) its buffer once.

Rules:

* forward: the collectives the IR's layers and layouts imply (`Layer.collectives`);
* backward: each forward collective's transpose on a tensor of the same size — an
  all-reduce for an all-reduce (Megatron's conjugate f/g pair), a reduce-scatter for an
  all-gather and back, an all-to-all for an all-to-all, the inverse permutation for a
  collective-permute. The loss's softmax statistics need none: its gradient is local once the
  forward statistics are known. Ring attention (context parallelism) also sends its key and
  value gradients around the ring (`attention.ring_backward_collectives`);
* recompute: a checkpointed block's forward collectives happen again in its backward, and the
  pipeline executor reruns every chunk's forward but the last's; inside the pipeline a mixture
  of experts recomputes its forward exchange once more in its backward
  (`moe.pipeline_recompute_collectives`);
* gradients: data-parallel reduction over the batch axes of every gradient the device holds —
  an all-reduce, or a reduce-scatter where ZeRO >= 2 splits that gradient; ZeRO 1 and 2 then
  all-gather the updated parameters, ZeRO 3 all-gathers them before the forward and again
  before the backward. Where attention rings over context axes, every layer saw only its
  share of the tokens, so each gradient is first all-reduced over those axes as well;
* pipeline: the executor sends one activation and one gradient buffer (a microbatch at the
  stage boundary) every tick, and sums the full-size gradient accumulator over the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dslc.ir.nodes import (
    DTYPE_BYTES,
    Axes,
    Block,
    Collective,
    Layer,
    Layout,
    Mesh,
    Node,
    Program,
    Residual,
    TensorType,
    all_layers,
    layers,
    weights_by_path,
)
from dslc.ir.state import state_sharding
from dslc.layers import LOSS_KINDS
from dslc.layers.attention import context_axes, ring_backward_collectives
from dslc.layers.moe import pipeline_recompute_collectives
from dslc.plan.activations import tensor_bytes
from dslc.plan.timetable import microbatch_slices, pipeline_figures, pipelined, stage_of

Phase = Literal["forward", "backward", "recompute", "gradients", "pipeline"]
Totals = dict[tuple[str, Axes, Phase], tuple[int, int]]
TRANSPOSE = {
    "all-reduce": "all-reduce",
    "all-gather": "reduce-scatter",
    "reduce-scatter": "all-gather",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
}


@dataclass(frozen=True, slots=True)
class Transfer:
    """One kind of collective in one phase of the step, summed over its occurrences."""

    kind: str
    axes: Axes
    phase: Phase
    bytes: int
    count: int


def ring_bytes(kind: str, group: int, size: int) -> int:
    """Bytes one device sends for a collective over `group` devices on a `size`-byte tensor."""
    if group <= 1:
        return 0
    match kind:
        case "all-reduce":
            return 2 * (group - 1) * size // group
        case "all-gather" | "reduce-scatter":
            return (group - 1) * size // group
        case "all-to-all":
            return (group - 1) * size // (group * group)
        case "collective-permute":
            return size // group
        case _:  # ppermute: the buffer itself
            return size


def _group_bytes(c: Collective, around: TensorType, mesh: Mesh) -> int:
    """The bytes of the whole tensor one group of the collective works on: the global tensor
    less the split of the other axes its tensor is sharded over (usually the batch's)."""
    others = tuple(a for a in around.axes_used if a not in c.axes)
    return c.elements * DTYPE_BYTES[c.dtype] // mesh.size(others)


def _node_collectives(node: Node, checkpointed: bool) -> list[tuple[Collective, TensorType, bool, bool]]:
    """(collective, the tensor it is on, whether it has a backward, whether it is recomputed)."""
    match node:
        case Layer():
            loss = node.kind in LOSS_KINDS
            return [(c, node.input, not loss, checkpointed) for c in node.collectives]
        case Layout():
            return [(c, node.input, True, checkpointed) for c in node.collectives]
        case Residual():
            return [x for n in node.body for x in _node_collectives(n, checkpointed)]
        case Block():
            inner = checkpointed or node.remat.policy != "none"
            return [x for n in node.body for x in _node_collectives(n, inner)]


def communication(program: Program) -> list[Transfer]:
    """Bytes sent by the busiest device. Under a pipeline a device runs only its own stage's
    layers, so their collectives are summed stage by stage and the busiest stage counts.

    A layer's collectives run once per slice of the batch (microbatch, accumulation step), each
    on that slice: their bytes add up to the whole batch's, their count is per slice."""
    mesh = program.mesh
    staged = pipelined(program)
    last = len(program.chunks) - 1
    slices = microbatch_slices(program)
    per_stage: dict[int, Totals] = {}
    stage = stage_of(program)
    for chunk in program.chunks:
        totals = per_stage.setdefault(stage[chunk.index], {})
        for node in chunk.nodes:
            for c, around, backward, recomputed in _node_collectives(node, False):
                size = _group_bytes(c, around, mesh)
                _add(totals, mesh, c.kind, c.axes, "forward", size, slices=slices)
                if backward:
                    _add(totals, mesh, TRANSPOSE[c.kind], c.axes, "backward", size, slices=slices)
                reruns = int(recomputed) + int(staged and chunk.index != last)
                if reruns:
                    _add(totals, mesh, c.kind, c.axes, "recompute", size, reruns, slices=slices)
            for layer in layers((node,)):
                for c in ring_backward_collectives(layer, mesh):
                    size = _group_bytes(c, layer.input, mesh)
                    _add(totals, mesh, c.kind, c.axes, "backward", size, slices=slices)
                for c in pipeline_recompute_collectives(layer, staged):
                    size = _group_bytes(c, layer.input, mesh)
                    _add(totals, mesh, c.kind, c.axes, "recompute", size, slices=slices)
    totals = max(per_stage.values(), key=lambda t: sum(b for b, _ in t.values()), default={})
    _gradient_sync(program, totals)
    if staged:
        _pipeline_sends(program, totals)
    return [Transfer(k, a, ph, b, n) for (k, a, ph), (b, n) in sorted(totals.items())]


def _add(
    totals: Totals, mesh: Mesh, kind: str, axes: Axes, phase: Phase, size: int, times: int = 1, *, slices: int = 1
) -> None:
    """Count a collective on a `size`-byte tensor, run `times` over, each time in `slices`
    pieces (one per slice of the batch) that together carry the whole tensor."""
    sent = ring_bytes(kind, mesh.size(axes), size) * times
    if sent:
        bytes_, count = totals.get((kind, axes, phase), (0, 0))
        totals[(kind, axes, phase)] = (bytes_ + sent, count + times * slices)


def batch_axes(program: Program) -> Axes:
    if not program.inputs:
        return ()
    return program.input(program.stream).type.sharding[0]


def _gradient_sync(program: Program, totals: Totals) -> None:
    mesh, zero = program.mesh, program.train.zero
    data = batch_axes(program)
    context = tuple(dict.fromkeys(a for layer in all_layers(program) for a in context_axes(layer, mesh)))
    for w in weights_by_path(program).values():
        summed = tuple(a for a in context if a not in w.type.axes_used)
        if summed:
            _add(totals, mesh, "all-reduce", summed, "gradients", w.type.local_nbytes(mesh))
        axes = tuple(a for a in data if a not in w.type.axes_used)
        if not axes:
            continue
        size = w.type.local_nbytes(mesh)
        state = state_sharding(w.type, program)
        split = state.spread_ok and zero >= 1
        _add(totals, mesh, "reduce-scatter" if split and zero >= 2 else "all-reduce", axes, "gradients", size)
        if split:
            _add(totals, mesh, "all-gather", axes, "gradients", size, 2 if zero >= 3 else 1)


def _pipeline_sends(program: Program, totals: Totals) -> None:
    p, figures = program.pipeline, pipeline_figures(program)
    assert p is not None and figures is not None
    mesh = program.mesh
    slices = microbatch_slices(program)
    outs = [chunk.nodes[-1].output for chunk in program.chunks[:-1] if chunk.nodes]
    boundary = max((tensor_bytes(t, mesh, slices) for t in outs), default=0)
    # Both directions, every tick, on every stage (see dslc/lower/pipeline.py).
    _add(totals, mesh, "ppermute", (p.axis,), "pipeline", boundary, 2 * figures.ticks * program.train.accumulate)
    full_grads = sum(w.type.local_nbytes(mesh) for w in weights_by_path(program).values())
    _add(totals, mesh, "all-reduce", (p.axis,), "pipeline", full_grads)
