"""Where the weights live: the arrays a step keeps, and each pipeline chunk's share of them.

A weight is kept in one of three ways:

* **stacked**: the weights of a `repeat` are one array per weight of its block, the layer
  index first (`blocks.*.attn.q`, [24, d, d]). When a pipeline gives every chunk an equal
  share of the repeat, in model order, that layer dimension is split over the stage axis, so
  each stage holds exactly its own layers (with `virtual` chunks per stage the array is
  [virtual, layers / virtual, ...], the stage axis on the second dimension: stage s then
  holds chunks s, s + P, ...).
* **per stage**: weights that the stages hold at the same place but in different shapes
  (stages written one by one, as `seed_mlp_pipeline` does) share one array with one row per
  stage, each row padded to the largest, the row dimension split over the stage axis.
* **whole**: any other weight. Without a pipeline it is kept as declared. Under a pipeline it
  is used by one stage (an embedding, a head), or by several (an embedding and the head tied
  to it), and kept split over the stage axis, along a dimension the stage count divides, the
  way FSDP splits over data: between steps each device holds 1/P of it; the step gathers it
  for the stages and reduce-scatters its gradient, the sum of every stage's.

This is decided once, here, from the IR: the code generator prints it (the module's
`PARAMETERS`), the planner counts it, and weights are exported and imported through it by
their stable per-layer names (`blocks.3.attn.q`), so one weights file loads on any mesh.
ZeRO / FSDP then split each array over the data axes (`dslc.ir.state`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from dslc.diagnostics import NO_SPAN, Span
from dslc.ir.nodes import Program, Sharding, StackedWeight, TensorType, stacked_weights
from dslc.ir.state import StateSharding, state_sharding
from dslc.runtime.storage import Held, Parameter, Row, weight_names

# An index into a stored array: one entry per leading dimension it selects, an int (one row)
# or a (start, stop) range.
Index = tuple[int | tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class StoredArray:
    """One array of trainable state as a step keeps it.

    `type` is its global shape, dtype and sharding between steps before ZeRO: declared axes,
    plus the stage axis where the pipeline splits it. `layers[k]` is how many leading
    dimensions the k-th `*` of `name` spans (a stacked weight; empty for a plain one).
    `rows` lists, for a per-stage array, what each stage's row holds. `stage_dim` is the
    dimension whose pieces are each stage's own (rows or layers); `split_dim` the dimension a
    whole weight is split along over the stage axis between steps (the step gathers it).
    """

    name: str
    type: TensorType
    init: str
    layers: tuple[int, ...] = ()
    rows: tuple[Row | None, ...] = ()
    stage_dim: int | None = None
    split_dim: int | None = None
    span: Span = field(default=NO_SPAN, compare=False, repr=False)  # where its (first) weight was written
    padding: tuple[int, ...] = ()  # its weights' own: a vocabulary padded to split evenly

    @property
    def lead(self) -> int:
        """Leading dimensions that index layers or rows rather than a weight's own."""
        return sum(self.layers) or int(bool(self.rows))

    @property
    def declared(self) -> tuple[int, ...]:
        """Its shape without the padding of its weights' own dimensions."""
        pads = (0,) * (self.type.rank - len(self.padding)) + self.padding
        return tuple(n - pad for n, pad in zip(self.type.shape, pads, strict=True))

    def state(self, program: Program) -> StateSharding:
        """Where its parameters, gradients and optimizer state live (ZeRO / FSDP)."""
        return state_sharding(self.type, program, self.lead)

    def parameter(self, sharding: object = None) -> Parameter:
        """As the generated module's `PARAMETERS` table states it (`sharding` as given)."""
        return Parameter(
            self.type.shape,
            self.type.dtype,
            self.init,
            sharding,
            layers=self.layers,
            rows=self.rows,
            stage_rows=self.stage_dim,
            stage_split=self.split_dim,
            padding=self.padding,
        )

    def weight_names(self) -> list[Held]:
        """Every per-layer weight it holds: its name, index into the array, shape and init."""
        return weight_names(self.name, self.parameter())


@dataclass(frozen=True, slots=True)
class Share:
    """What one chunk computes with out of a stored array: `rows`, an index of its leading
    dimensions (the whole array when empty), and the shape it has there (a row's own shape,
    within its padding)."""

    stored: str
    rows: Index
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    arrays: tuple[StoredArray, ...]
    # Per chunk, its weights by the name its code uses (`blocks.*.attn.q`, `fc3.kernel`).
    shares: tuple[dict[str, Share], ...]

    def array(self, name: str) -> StoredArray:
        return next(a for a in self.arrays if a.name == name)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every per-layer weight name and its shape."""
        return {held.name: held.shape for a in self.arrays for held in a.weight_names()}


def place(program: Program) -> Placement:
    """Where each of the program's weights is kept, and each chunk's share."""
    leaves = [[sw for sw in _unique(stacked_weights(chunk.nodes))] for chunk in program.chunks]
    if not program.pipelined:
        return _unpipelined(program, leaves)
    axis = program.pipeline.axis if program.pipeline else ""
    arrays: list[StoredArray] = []
    shares: list[dict[str, Share]] = [{} for _ in program.chunks]
    left: list[list[StackedWeight]] = [[] for _ in program.chunks]
    by_name: dict[str, list[tuple[int, StackedWeight]]] = defaultdict(list)
    for c, chunk_leaves in enumerate(leaves):
        for sw in chunk_leaves:
            by_name[sw.name].append((c, sw))
    for name, group in by_name.items():
        if len(group) > 1 and not group[0][1].repeats:
            # One weight that several chunks read (a head tied to the embedding): one array,
            # all of it each chunk's share.
            array = _whole(program, group[0][1], axis)
            arrays.append(array)
            for c, sw in group:
                shares[c][name] = Share(name, (), _leaf_shape(sw))
            continue
        stacked = _stacked_over_stages(program, group, axis)
        if stacked is None:
            for c, sw in group:
                left[c].append(sw)
            continue
        array, index = stacked
        arrays.append(array)
        for c, sw in group:
            shares[c][name] = Share(name, index[c], _leaf_shape(sw))
    packed, alone = _pack_per_stage(program, left, axis)
    for array, members in packed:
        arrays.append(array)
        for c, sw, row in members:
            shares[c][sw.name] = Share(array.name, (row,), _leaf_shape(sw))
    for c, sw in alone:
        array = _whole(program, sw, axis)
        arrays.append(array)
        shares[c][sw.name] = Share(array.name, (), _leaf_shape(sw))
    # In model order: each array where its first weight is first used, each chunk's weights
    # in the order its layers use them.
    first_use = {name: i for i, name in reversed(list(enumerate(sw.name for chunk in leaves for sw in chunk)))}
    arrays.sort(key=lambda a: min(first_use[r.name] for r in a.rows if r) if a.rows else first_use[a.name])
    ordered = tuple({sw.name: mine[sw.name] for sw in chunk} for chunk, mine in zip(leaves, shares, strict=True))
    return Placement(tuple(arrays), ordered)


# ---- without a pipeline -------------------------------------------------------------------------


def _unpipelined(program: Program, leaves: list[list[StackedWeight]]) -> Placement:
    arrays: dict[str, StoredArray] = {}
    shares: list[dict[str, Share]] = []
    for chunk_leaves in leaves:
        mine: dict[str, Share] = {}
        for sw in chunk_leaves:
            if sw.name not in arrays:
                t = sw.stored.type
                stacked = TensorType(t.dtype, sw.shape, ((),) * len(sw.repeats) + t.sharding)
                arrays[sw.name] = StoredArray(
                    sw.name,
                    stacked,
                    sw.stored.init,
                    (1,) * len(sw.repeats),
                    span=sw.stored.span,
                    padding=sw.stored.padding,
                )
            mine[sw.name] = Share(sw.name, _piece(sw), _leaf_shape(sw))
        shares.append(mine)
    return Placement(tuple(arrays.values()), tuple(shares))


# ---- stacked over the stages -------------------------------------------------------------------


def _stacked_over_stages(
    program: Program, group: list[tuple[int, StackedWeight]], axis: str
) -> tuple[StoredArray, dict[int, Index]] | None:
    """A repeat's weight that every chunk holds an equal share of, in model order, on the stage
    the standard placement gives it (chunk c on stage c mod P): stacked with its layer
    dimension split over the stage axis."""
    stages = program.stages
    chunks = len(program.chunks)
    first = group[0][1]
    if not first.repeats or len(group) != chunks:
        return None
    run = first.repeats[0]
    if run.length % chunks:
        return None
    per = run.length // chunks
    for c, sw in group:
        piece = sw.repeats[0]
        if piece.first != c * per or piece.count != per or program.chunks[c].stage != c % stages:
            return None
    t = first.stored.type
    inner = first.shape[1:]
    inner_sharding = ((),) * (len(first.repeats) - 1) + t.sharding
    virtual = chunks // stages
    if virtual == 1:
        stored = TensorType(t.dtype, (run.length, *inner), ((axis,), *inner_sharding))
        index: dict[int, Index] = {c: ((c * per, (c + 1) * per),) for c, _ in group}
        layers = (1,) * len(first.repeats)
        stage_dim = 0
    else:
        stored = TensorType(t.dtype, (virtual, stages * per, *inner), ((), (axis,), *inner_sharding))
        index = {c: (c // stages, ((c % stages) * per, (c % stages + 1) * per)) for c, _ in group}
        layers = (2, *(1,) * (len(first.repeats) - 1))
        stage_dim = 1
    return StoredArray(
        first.name,
        stored,
        first.stored.init,
        layers,
        stage_dim=stage_dim,
        span=first.stored.span,
        padding=first.stored.padding,
    ), index


# ---- one row per stage ----------------------------------------------------------------------------


def _pack_per_stage(
    program: Program, left: list[list[StackedWeight]], axis: str
) -> tuple[list[tuple[StoredArray, list[tuple[int, StackedWeight, int]]]], list[tuple[int, StackedWeight]]]:
    """Weights that stages hold in the same kind (dtype, rank, sharding) share arrays with a
    row per stage: first the shares of one repeat (or weights of one name) on each stage,
    then the rest, the largest of each stage with the largest of the others, so the padding
    is small. A weight no other stage has a partner for is left alone — but a share of a
    repeat keeps a row of its own even then, as the rest of the repeat is elsewhere."""
    stages = program.stages
    kinds: dict[tuple[str, int, Sharding], list[list[tuple[int, StackedWeight]]]] = defaultdict(
        lambda: [[] for _ in range(stages)]
    )
    alone: list[tuple[int, StackedWeight]] = []
    for c, chunk_leaves in enumerate(left):
        stage = program.chunks[c].stage
        for sw in chunk_leaves:
            if sw.stored.padding:
                # Rows export each weight at its row's shape; a padded one keeps an array of its own.
                alone.append((c, sw))
                continue
            t = sw.stored.type
            key = (t.dtype, len(_leaf_shape(sw)), ((),) * len(sw.repeats) + t.sharding)
            kinds[key][stage].append((c, sw))
    packed: list[tuple[StoredArray, list[tuple[int, StackedWeight, int]]]] = []
    for (dtype, _, sharding), per_stage in kinds.items():
        for slot in _slots(per_stage):
            present = [s for s in slot if s is not None]
            if len(present) < 2 and not _is_share(present[0][1]):
                alone.extend(present)
                continue
            shapes = [_leaf_shape(sw) for _, sw in present]
            padded = tuple(max(dims) for dims in zip(*shapes, strict=True))
            rows = tuple(
                None if s is None else Row(s[1].name, _leaf_shape(s[1]), s[1].stored.init, _first(s[1])) for s in slot
            )
            members = [row for row in rows if row is not None]
            # Rows of one weight (a repeat's shares) are named after it and the first layer
            # of their first row; rows of different weights after them all.
            same = len({row.name for row in members}) == 1
            name = f"{members[0].name}@{members[0].first}" if same else "|".join(row.name for row in members)
            t = TensorType(dtype, (stages, *padded), ((axis,), *sharding))
            array = StoredArray(name, t, "rows", rows=rows, stage_dim=0, span=present[0][1].stored.span)
            # Each member's row is its stage's.
            packed.append((array, [(c, sw, program.chunks[c].stage) for c, sw in present]))
    return packed, alone


Slot = list[tuple[int, StackedWeight] | None]


def _slots(per_stage: list[list[tuple[int, StackedWeight]]]) -> list[Slot]:
    """One entry per stage in each slot: the k-th weight of a name on every stage that has
    one, then the remaining weights paired largest with largest."""
    slots: list[Slot] = []
    rest: list[list[tuple[int, StackedWeight]]] = [[] for _ in per_stage]
    names = {sw.name for mine in per_stage for _, sw in mine}
    for name in sorted(names):
        of = [[item for item in mine if item[1].name == name] for mine in per_stage]
        shared = min(len(mine) for mine in of)
        for k in range(shared):
            slots.append([mine[k] for mine in of])
        for stage, mine in enumerate(of):
            rest[stage].extend(mine[shared:])
    for mine in rest:
        mine.sort(key=lambda item: (-math.prod(_leaf_shape(item[1])), item[1].name))
    for j in range(max((len(m) for m in rest), default=0)):
        slots.append([m[j] if j < len(m) else None for m in rest])
    return slots


def _is_share(sw: StackedWeight) -> bool:
    """Whether a weight is a chunk's share of a repeat that other chunks share too."""
    return bool(sw.repeats) and sw.repeats[0].count < sw.repeats[0].length


def _first(sw: StackedWeight) -> int:
    return sw.repeats[0].first if sw.repeats else 0


# ---- whole ----------------------------------------------------------------------------------------


def _whole(program: Program, sw: StackedWeight, axis: str) -> StoredArray:
    """A weight one stage uses (or a tied one, several), kept split over the stage axis between
    steps where a dimension divides (its own declared axes stay), else whole on every stage."""
    t = sw.stored.type
    sharding: Sharding = ((),) * len(sw.repeats) + t.sharding
    shape = sw.shape
    stages = program.stages
    for dim, (n, current) in enumerate(zip(shape, sharding, strict=True)):
        if n % (program.mesh.size(current) * stages) == 0:
            split = tuple((*axes, axis) if i == dim else axes for i, axes in enumerate(sharding))
            stored = TensorType(t.dtype, shape, split)
            return StoredArray(
                sw.name,
                stored,
                sw.stored.init,
                (1,) * len(sw.repeats),
                split_dim=dim,
                span=sw.stored.span,
                padding=sw.stored.padding,
            )
    return StoredArray(
        sw.name,
        TensorType(t.dtype, shape, sharding),
        sw.stored.init,
        (1,) * len(sw.repeats),
        span=sw.stored.span,
        padding=sw.stored.padding,
    )


# ---- helpers ---------------------------------------------------------------------------------------


def _unique(weights: list[StackedWeight]) -> list[StackedWeight]:
    seen: set[str] = set()
    out = []
    for sw in weights:
        if sw.name not in seen:
            seen.add(sw.name)
            out.append(sw)
    return out


def _leaf_shape(sw: StackedWeight) -> tuple[int, ...]:
    """The shape a chunk computes with: its own share of the outermost repeat."""
    if not sw.repeats:
        return sw.stored.type.shape
    return (sw.repeats[0].count, *sw.shape[1:])


def _piece(sw: StackedWeight) -> Index:
    if not sw.repeats or sw.repeats[0].count == sw.repeats[0].length:
        return ()
    r = sw.repeats[0]
    return ((r.first, r.first + r.count),)
