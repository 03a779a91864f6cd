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
  value gradients around the ring (`backward_collectives` of the layer's rule);
* recompute: a checkpointed block's forward collectives happen again in its backward; a
  schedule that splits the backward (zb-h1) pulls each gradient through its chunk twice, so
  the backward's collectives happen again; inside the pipeline a mixture of experts
  recomputes its forward exchange once more in its backward
  (`pipeline_recompute_collectives` of the layer's rule);
* gradients: data-parallel reduction over the batch axes of every gradient the device holds
  (under a pipeline, its own stage's) once per step — once per slice of the batch over an
  axis that splits parameters (ZeRO-3, experts; see `ir.data_parallel`) —
  an all-reduce, or a reduce-scatter where ZeRO >= 2 splits that gradient, or where ZeRO 1
  splits its optimizer state and the step sums the gradients by hand (ZeRO's 1.97Ψ on 64
  devices, not an all-reduce and a gather, 2.95Ψ); ZeRO 1 and 2 then
  all-gather the updated parameters, ZeRO 3 all-gathers them before the forward and again
  before the backward. Where attention rings over context axes, every layer saw only its
  share of the tokens, so each gradient is first all-reduced over those axes as well;
* pipeline: at each tick every stage sends one buffer (a microbatch at the stage boundary:
  its forward's output or its backward's input gradient) to both neighbours, one permutation
  each way (one in all on two stages, where they are the same stage); a weight kept split
  over the stage axis between steps (an embedding, a head) is gathered once per step and its
  gradient reduce-scattered back. No gradient is summed over the stage axis: each stage holds
  only its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dslc.ir.data_parallel import data_parallel_axes
from dslc.ir.nodes import (
    DTYPE_BYTES,
    Axes,
    Block,
    Branches,
    Collective,
    Layer,
    Layout,
    Mesh,
    Node,
    Program,
    Repeat,
    Residual,
    Sharding,
    Stream,
    TensorType,
    all_layers,
    counted_layers,
)
from dslc.ir.placement import place
from dslc.ir.schedule import microbatch_slices, pipeline_figures, splits_backward, stage_of
from dslc.layers import RULES
from dslc.plan.activations import tensor_bytes

Phase = Literal["forward", "backward", "recompute", "gradients", "pipeline"]
Totals = dict[tuple[str, Axes, Phase, bool], tuple[int, int]]
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
    # Whether a compiled program that overlaps collectives (`dslc.train.overlap`) can run it
    # under compute: ZeRO-3/FSDP's parameter gathers, prefetched a layer ahead, and gradient
    # reductions XLA issues where each layer's gradient is made. Not: tensor-parallel
    # collectives (the next product needs their result), pipeline sends, all-to-alls, and the
    # sums a step makes by hand once, after its last slice.
    hideable: bool = False


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


def _node_collectives(node: Node, checkpointed: bool) -> list[tuple[Collective, TensorType, bool, bool, int]]:
    """(collective, the tensor it is on, whether it has a backward, whether it is recomputed,
    how many times one pass runs it)."""
    match node:
        case Layer():
            return [(c, node.input, not RULES[node.kind].is_loss, checkpointed, 1) for c in node.collectives]
        case Layout():
            return [(c, node.input, True, checkpointed, 1) for c in node.collectives]
        case Residual() | Branches() | Stream():
            return [x for n in node.body for x in _node_collectives(n, checkpointed)]
        case Repeat():
            return [(c, t, b, r, n * node.count) for c, t, b, r, n in _node_collectives(node.body, checkpointed)]
        case Block():
            inner = checkpointed or node.remat.reruns_block
            return [x for n in node.body for x in _node_collectives(n, inner)]


def communication(program: Program) -> list[Transfer]:
    """Bytes sent by the busiest device. Under a pipeline a device runs only its own stage's
    layers, so their collectives are summed stage by stage and the busiest stage counts.

    A layer's collectives run once per slice of the batch (microbatch, accumulation step), each
    on that slice: their bytes add up to the whole batch's, their count is per slice."""
    mesh = program.mesh
    staged = program.pipelined
    split = splits_backward(program)
    slices = microbatch_slices(program)
    per_stage: dict[int, Totals] = {}
    stage = stage_of(program)
    for chunk in program.chunks:
        totals = per_stage.setdefault(stage[chunk.index], {})
        for node in chunk.nodes:
            for c, around, backward, recomputed, times in _node_collectives(node, False):
                size = _group_bytes(c, around, mesh)
                _add(totals, mesh, c.kind, c.axes, "forward", size, times, slices=slices)
                if backward:
                    _add(totals, mesh, TRANSPOSE[c.kind], c.axes, "backward", size, times, slices=slices)
                if recomputed:
                    _add(totals, mesh, c.kind, c.axes, "recompute", size, times, slices=slices)
                if backward and split:
                    # The weight-gradient tick pulls the gradient through the chunk again.
                    _add(totals, mesh, TRANSPOSE[c.kind], c.axes, "recompute", size, times, slices=slices)
            for layer, times in counted_layers((node,)):
                rule = RULES[layer.kind]
                for c in rule.backward_collectives(layer, mesh):
                    size = _group_bytes(c, layer.input, mesh)
                    _add(totals, mesh, c.kind, c.axes, "backward", size, times, slices=slices)
                for c in rule.pipeline_recompute_collectives(layer) if staged else ():
                    size = _group_bytes(c, layer.input, mesh)
                    _add(totals, mesh, c.kind, c.axes, "recompute", size, times, slices=slices)
    totals = max(per_stage.values(), key=lambda t: sum(b for b, _ in t.values()), default={})
    _gradient_sync(program, totals)
    if staged:
        _pipeline_sends(program, totals)
    return [Transfer(k, a, ph, b, n, hide) for (k, a, ph, hide), (b, n) in sorted(totals.items())]


def _add(
    totals: Totals,
    mesh: Mesh,
    kind: str,
    axes: Axes,
    phase: Phase,
    size: int,
    times: int = 1,
    *,
    slices: int = 1,
    hideable: bool = False,
) -> None:
    """Count a collective on a `size`-byte tensor, run `times` over, each time in `slices`
    pieces (one per slice of the batch) that together carry the whole tensor."""
    sent = ring_bytes(kind, mesh.size(axes), size) * times
    if sent:
        bytes_, count = totals.get((kind, axes, phase, hideable), (0, 0))
        totals[(kind, axes, phase, hideable)] = (bytes_ + sent, count + times * slices)


def batch_axes(program: Program) -> Axes:
    if not program.inputs:
        return ()
    return program.input(program.stream).type.sharding[0]


def _gradient_sync(program: Program, totals: Totals) -> None:
    """Once per step, for every array of the stage's: its gradient reduced over the batch axes
    (and over the context axes where attention rings), as ZeRO says. Over batch axes a step
    does not run data-parallel by hand (`data_parallel_axes`: ZeRO-3's, experts'), XLA
    reduces each slice's gradient (microbatch, accumulation step) as it is made."""
    mesh, zero = program.mesh, program.train.zero
    data = batch_axes(program)
    once = data_parallel_axes(program)
    slices = microbatch_slices(program)
    context = tuple(
        dict.fromkeys(a for layer in all_layers(program) for a in RULES[layer.kind].context_axes(layer, mesh))
    )
    for array in place(program).arrays:
        t = array.type
        size = t.local_nbytes(mesh)
        summed = tuple(a for a in context if a not in t.axes_used)
        if summed:
            _add(totals, mesh, "all-reduce", summed, "gradients", size, hideable=True)
        axes = tuple(a for a in data if a not in t.axes_used)
        if not axes:
            continue
        state = array.state(program)
        split = state.spread_ok and zero >= 1
        times = 1 if set(axes) <= set(once) else slices
        # ZeRO 2 keeps the gradient split; ZeRO 1 reduce-scatters it into the optimizer
        # state's pieces where the step sums it by hand.
        scattered = split and (zero >= 2 or (times == 1 and bool(once) and _ends(axes, state.optimizer)))
        # Summed by hand, once after the last slice: nothing left to run under. Summed by XLA,
        # where each layer's gradient is made: under the rest of the backward.
        by_hand = set(axes) <= set(once)
        kind = "reduce-scatter" if scattered else "all-reduce"
        _add(totals, mesh, kind, axes, "gradients", size, times, hideable=not by_hand)
        if split:
            # ZeRO-3 gathers each layer before its forward and its backward (a layer ahead,
            # under the one before); ZeRO 1 and 2 gather the updated weights after the update.
            _add(totals, mesh, "all-gather", axes, "gradients", size, 2 if zero >= 3 else 1, hideable=zero >= 3)


def _ends(axes: Axes, sharding: Sharding) -> bool:
    """Whether `axes` end one dimension's entry of `sharding`: a reduce-scatter over them
    then leaves each device its piece (`kernels.training.data_parallel`)."""
    return any(len(entry) >= len(axes) and entry[len(entry) - len(axes) :] == axes for entry in sharding)


def sends_per_tick(stages: int) -> int:
    """Permutations a pipeline tick makes: one buffer to both neighbours round the ring of
    `stages`, one permutation in all on two stages (the previous stage is the next)."""
    return 1 if stages == 2 else 2


def _pipeline_sends(program: Program, totals: Totals) -> None:
    """The executor sends one buffer (a microbatch at the widest stage boundary) a tick to both
    neighbours: two permutations, one on two stages. It skips ticks at which nothing arrives
    anywhere, which are counted all the same (a bound: 4 of gpt_small's 10 ticks on 2 stages
    send nothing, few of a long schedule's). The weights split over the stage axis between
    steps are gathered for the step and their gradients reduce-scattered back."""
    p, figures = program.pipeline, pipeline_figures(program)
    assert p is not None and figures is not None
    mesh = program.mesh
    slices = microbatch_slices(program)
    boundary = max((tensor_bytes(t, mesh, slices) for t in program.boundaries), default=0)
    sends = sends_per_tick(program.stages) * figures.ticks * program.train.accumulate
    _add(totals, mesh, "ppermute", (p.axis,), "pipeline", boundary, sends)
    for array in place(program).arrays:
        if array.split_dim is None:
            continue
        whole = TensorType(
            array.type.dtype,
            array.type.shape,
            tuple(tuple(a for a in axes if a != p.axis) for axes in array.type.sharding),
        )
        size = whole.local_nbytes(mesh)
        _add(totals, mesh, "all-gather", (p.axis,), "pipeline", size, program.train.accumulate)
        _add(totals, mesh, "reduce-scatter", (p.axis,), "pipeline", size, program.train.accumulate)
