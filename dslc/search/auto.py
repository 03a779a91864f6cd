"""`dslc plan --mesh auto`: the mesh, pipeline schedule and microbatch count that make a
training step fastest within the devices' memory.

For N devices of G bytes each:

1. Roles. Each mesh axis gets a role from how the spec uses it: the axes that split the batch
   are data axes, the axis the `pipeline` section names is the pipeline axis, and any other
   axis that splits a weight or an activation is tensor-like (tensor, expert, context). An
   axis the spec does not use stays 1.
2. Meshes: every ordered factorization of N over the used axes, less those whose data axes do
   not divide the batch (E020 whatever the microbatch count).
3. Groups: a mesh with a virtual count V (1, or 2 to MAX_VIRTUAL for interleaved-1f1b on two
   or more stages). The schedule and the microbatch count change no layer, so a group is
   elaborated once and its (schedule, microbatches) candidates are `dataclasses.replace`s of
   that one program. Before a group is elaborated, its training state (parameters, gradients,
   accumulators, optimizer state, inputs: memory no schedule changes) is counted from the
   spec's weights; a group whose state alone exceeds G is ruled out unelaborated.
4. Candidates: each schedule kind with each microbatch count that divides the per-shard batch
   (a multiple of the stage count for interleaved-1f1b), costed by `step_time` from the
   group's FLOPs and collectives (the planner's own figures) and the schedule's bubble and
   pipeline sends.
5. Best first. Groups and candidates wait in one queue ordered by step time (a group by a lower
   bound on its candidates'). The first candidate taken that fits in G and that the checker
   accepts is the fastest plan that fits: every faster candidate was taken before it and did
   not fit, or belongs to a group ruled out by its memory or by the checker. The search then
   takes a few runners-up, to say by how much they lose.

A candidate's memory is the planner's (`dslc.plan.memory`), assembled from pieces that are
computed once per group (everything but the activations) and once per microbatch count (the
activations); tests/plan/test_auto_mesh.py holds the two equal.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import cast

from dslc.check import check_program
from dslc.diagnostics import Diagnostic, Diagnostics, Span
from dslc.elaborate import elaborate
from dslc.ir.evaluate import ScalarValue
from dslc.ir.nodes import Mesh, MeshAxis, Program, TensorType, weights_by_path
from dslc.plan.activations import tensor_bytes
from dslc.plan.communication import Transfer, communication, ring_bytes, sends_per_tick
from dslc.plan.flops import busiest_stage_flops, flops
from dslc.plan.memory import Memory, memory
from dslc.plan.memory import training_state as memory_state
from dslc.plan.roles import read_roles
from dslc.plan.step_time import PER_MICROBATCH, Hardware, StepTime, node_local_axes, step_time
from dslc.schedules import KINDS, SPLIT_BACKWARD, V_KINDS, Kind, ScheduleError, placement
from dslc.schedules.figures import Figures, figures
from dslc.search.report import AutoPlan, Candidate, Excluded
from dslc.syntax import ast

# The most chunks per stage tried: the bubble shrinks as 1/V while the stash slots, the sends
# and the executor's reruns grow with V, so past a few the search would only cost time.
MAX_VIRTUAL = 8
# Fitting plans reported after the chosen one.
RUNNERS_UP = 4
INTERLEAVED = "interleaved-1f1b"
ONE_CHUNK_KINDS = ("1f1b", "zb-h1", "gpipe")
SEARCHED_WHEN_NAMED = ("v-half",)
# The errors that depend only on how many pipeline chunks there are (stages x virtual).
CHUNKING = ("E018", "E019")
# The errors that depend only on the sizes of the axes that split weights and features: a
# dimension, or the attention heads, that those sizes do not divide.
SHAPES = ("E014", "E015")


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered way of writing n as a product of `parts` positive factors."""
    if parts == 0:
        if n == 1:
            yield ()
        return
    for d in divisors(n):
        for rest in factorizations(n // d, parts - 1):
            yield (d, *rest)


@dataclass(frozen=True, slots=True)
class _Group:
    """A mesh and a virtual count: one elaboration, and the candidates it serves."""

    sizes: tuple[int, ...]
    virtual: int
    options: tuple[tuple[str | None, int | None], ...]  # (schedule, microbatches); (None, None) without pipeline
    state: int  # bytes per device that no schedule changes (see `training_state`)
    bubble_floor: float  # the smallest bubble fraction among its options


@dataclass
class _Costed:
    """An elaborated group with what its candidates' costs are made of."""

    group: _Group
    program: Program  # checked, with the group's first option as its pipeline settings
    intra: frozenset[str]
    # FLOPs per device on the busiest stage and the planner's transfers less the pipeline
    # sends (they depend on the schedule), for schedules that split the backward and not.
    costs: dict[bool, tuple[float, tuple[Transfer, ...]]] = field(default_factory=dict)

    def cost(self, schedule: str | None) -> tuple[float, tuple[Transfer, ...]]:
        split = schedule in SPLIT_BACKWARD
        if split not in self.costs:
            program = self.program
            if program.pipeline is not None and schedule is not None:
                program = with_schedule(program, schedule, program.pipeline.microbatches)
            transfers = tuple(t for t in communication(program) if t.kind != "ppermute")
            self.costs[split] = (busiest_stage_flops(program), transfers)
        return self.costs[split]

    def sliced(self, schedule: str | None, microbatches: int | None) -> tuple[Transfer, ...]:
        """The transfers with each layer collective's count for `microbatches` instead of the
        group's first option's: a layer's collectives run once per microbatch."""
        transfers = self.cost(schedule)[1]
        first = self.group.options[0][1]
        if not (self.program.pipelined and first and microbatches) or first == microbatches:
            return transfers
        return tuple(
            replace(t, count=t.count // first * microbatches) if t.phase in PER_MICROBATCH else t for t in transfers
        )

    @cached_property
    def planned(self) -> Memory:
        """The planner's memory for the group's first option: all of it but the activations holds
        for every option (counted only once one of them is judged: it takes a while)."""
        return memory(self.program)

    @property
    def base_memory(self) -> int:
        return self.planned.total - self.planned.activations

    @cached_property
    def boundaries(self) -> tuple[TensorType, ...]:
        """What one stage sends the next: each chunk's output but the last's."""
        return tuple(c.nodes[-1].output for c in self.program.chunks[:-1] if c.nodes)

    def boundary(self, slices: int) -> int:
        """Bytes of one slice of the batch at the widest stage boundary."""
        return max((tensor_bytes(t, self.program.mesh, slices) for t in self.boundaries), default=0)


@dataclass(frozen=True, slots=True)
class _Pending:
    """A costed candidate waiting to have its memory counted and to be checked."""

    costed: _Costed
    schedule: str | None
    microbatches: int | None
    figures: Figures | None
    time: StepTime
    sent: int

    @property
    def program(self) -> Program:
        """The group's program with this candidate's pipeline settings."""
        program = self.costed.program
        if program.pipeline is None or self.schedule is None or self.microbatches is None:
            return program
        return with_schedule(program, self.schedule, self.microbatches)


def with_schedule(program: Program, schedule: str, microbatches: int) -> Program:
    """`program` run by another schedule: its pipeline settings, and its chunks on the stages
    that schedule places them on (a V puts chunk 2P-1-d on stage d), which decides how the
    stages store their weights."""
    assert program.pipeline is not None
    settings = replace(program.pipeline, schedule=schedule, microbatches=microbatches)
    try:
        stages = placement(schedule, program.stages, program.pipeline.virtual)
    except ScheduleError:
        stages = ()
    chunks = program.chunks
    if len(stages) == len(chunks):
        chunks = tuple(
            replace(c, stage=stages[c.index], virtual=stages[: c.index].count(stages[c.index])) for c in chunks
        )
    return replace(program, pipeline=settings, chunks=chunks)


class AutoPlanner:
    """Searches the plans of one spec on `devices` devices of `device_memory` bytes each.

    `module` is the parsed spec and `reference` its program on the spec's own mesh (checked or
    not: it is read for the roles of the axes, the weights and the FLOPs, none of which depend
    on the mesh sizes). `schedules` limits the pipeline schedules tried.
    """

    def __init__(
        self,
        module: ast.Module,
        reference: Program,
        devices: int,
        device_memory: int,
        hardware: Hardware | None = None,
        overrides: Mapping[str, ScalarValue] | None = None,
        schedules: Sequence[str] | None = None,
    ) -> None:
        self.module = module
        self.reference = reference
        self.devices = devices
        self.device_memory = device_memory
        self.hardware = hardware or Hardware()
        self.overrides = dict(overrides or {})
        # v-half has no closed form: its tables are built to be costed, which takes seconds
        # each on a large pipeline, so it is searched only when named.
        self.kinds = tuple(
            k for k in KINDS if (k in schedules if schedules is not None else k not in SEARCHED_WHEN_NAMED)
        )
        self.roles = read_roles(reference)
        self.batch = reference.input(reference.stream).type.shape[0] if reference.inputs else 1
        self.model_flops = flops(reference).model
        self.weight_types = Counter(w.type for w in weights_by_path(reference).values())
        self.excluded: list[Excluded] = []
        self.sync: dict[tuple[int, ...], float] = {}  # per mesh: the once-per-step collectives' seconds
        # Pipeline chunk counts the layers do not split into (E018, E019), whatever the mesh.
        self.unsplittable: dict[int, str] = {}
        # Sizes of the shaping axes that leave a dimension or the heads unsplittable, whatever
        # the sizes of the data and pipeline axes (the batch split is checked before).
        self.misshapen: dict[tuple[int, ...], str] = {}
        # Meshes the checker rejects for any other reason, whatever the virtual count.
        self.illegal: dict[tuple[int, ...], str] = {}
        self.elaborated = 0
        self.costed = 0

    # ---- the search ------------------------------------------------------------------------------

    def search(self, meshes: Collection[tuple[int, ...]] | None = None) -> AutoPlan:
        """The fastest plan that fits, and the candidates that lost to it; with `meshes`, only
        plans on those meshes (the best schedule and microbatch count for a given mesh)."""
        self.excluded = []
        self.elaborated = self.costed = 0
        queue: list[tuple[float, int, _Group | _Pending]] = []
        order = 0

        def push(key: float, item: _Group | _Pending) -> None:
            nonlocal order
            heapq.heappush(queue, (key, order, item))
            order += 1

        too_big: list[_Group] = []
        for group in self.groups():
            if meshes is not None and group.sizes not in meshes:
                continue
            if group.state > self.device_memory:
                self.excluded.append(Excluded(group.sizes, group.virtual, "its training state alone", group.state))
                too_big.append(group)
            else:
                push(self._bound(group), group)
        ranked: list[Candidate] = []
        chosen: Candidate | None = None
        breakdown: Memory | None = None
        runners_up = 0
        while queue and runners_up < RUNNERS_UP:
            key, _, item = heapq.heappop(queue)
            if isinstance(item, _Group):
                bound = self._bound(item)
                if bound > key:  # a sibling's gradient reductions are now known: wait for that bound
                    push(bound, item)
                    continue
                costed = self._elaborate(item)
                if isinstance(costed, str):
                    self.excluded.append(Excluded(item.sizes, item.virtual, costed, None))
                    continue
                for pending in self._candidates(costed):
                    push(pending.time.total, pending)
                continue
            candidate = self._judge(item)
            ranked.append(candidate)
            if candidate.accepted:
                if chosen is None:
                    chosen, breakdown = candidate, memory(item.program)
                else:
                    runners_up += 1
        return AutoPlan(
            model=self.reference.name,
            axes=tuple((a, self.roles.role(a)) for a in self.roles.names),
            pipeline_axis=self.roles.pipeline,
            devices=self.devices,
            device_memory=self.device_memory,
            hardware=self.hardware,
            chosen=chosen,
            memory=breakdown,
            closest=None if chosen else self._closest(ranked, too_big),
            ranked=tuple(ranked),
            excluded=tuple(self.excluded),
            elaborated=self.elaborated,
            costed=self.costed,
            across_nodes=self.reference.mesh.across_nodes,
        )

    def _closest(self, judged: list[Candidate], too_big: list[_Group]) -> tuple[tuple[int, ...], int, bool] | None:
        """When nothing fits: the plan that needs the least memory (mesh, bytes, whether the bytes
        are exact rather than a lower bound), among those judged and the groups whose training
        state alone was too much, taking the latter in order and skipping those the checker
        rejects (they were never elaborated)."""
        known = sorted(
            [(c.memory, not c.memory_exact, c.mesh, None) for c in judged]
            + [(g.state, True, g.sizes, g) for g in too_big],
            key=lambda k: k[:3],
        )
        for size, bound, mesh, group in known:
            if group is None or not isinstance(self._elaborate(group), str):
                return mesh, size, not bound
        return None

    # ---- groups ---------------------------------------------------------------------------------

    def groups(self) -> Iterator[_Group]:
        used = self.roles.used
        accumulate = self.reference.train.accumulate
        for factors in factorizations(self.devices, len(used)):
            size = dict(zip(used, factors, strict=True))
            sizes = tuple(size.get(a, 1) for a in self.roles.names)
            shards = math.prod(size.get(a, 1) for a in self.roles.data) * accumulate
            if self.batch % shards:
                continue
            stages = self._stages(sizes)
            most = 1
            if stages > 1 and INTERLEAVED in self.kinds:
                most = MAX_VIRTUAL
            elif stages > 1 and any(k in V_KINDS for k in self.kinds):
                most = 2
            for virtual in range(1, most + 1):
                options = self._options(stages, virtual, self.batch // shards)
                if options:
                    yield self._group(sizes, virtual, options)

    def _options(self, stages: int, virtual: int, per_shard: int) -> tuple[tuple[str | None, int | None], ...]:
        p = self.reference.pipeline
        if p is None:
            return ((None, None),)
        if stages == 1:
            # No pipeline runs on one stage: the schedule and microbatches change nothing, so
            # keep the spec's where the checker allows them.
            kinds: list[str] = [k for k in (p.schedule, *self.kinds) if k in ONE_CHUNK_KINDS and k in self.kinds]
            return ((kinds[0], p.microbatches if per_shard % p.microbatches == 0 else 1),) if kinds else ()
        # On equal step times the first kind wins: 1F1B, whose buffers are the fewest.
        if virtual == 1:
            kinds = [k for k in ONE_CHUNK_KINDS if k in self.kinds]
        else:
            kinds = [k for k in (INTERLEAVED, *(V_KINDS if virtual == 2 else ())) if k in self.kinds]
        counts = divisors(per_shard)
        return tuple(
            (k, m)
            for k in kinds
            for m in counts
            if (k != INTERLEAVED or m % stages == 0) and _plannable(k, stages, m, virtual)
        )

    def _group(
        self, sizes: tuple[int, ...], virtual: int, options: tuple[tuple[str | None, int | None], ...]
    ) -> _Group:
        stages = self._stages(sizes)
        staged = stages * virtual > 1
        floor = min(
            figures(cast(Kind, k), stages, m, virtual).bubble_fraction if staged and k and m else 0.0
            for k, m in options
        )
        return _Group(sizes, virtual, options, self.training_state(sizes, stages if staged else 1), floor)

    def _stages(self, sizes: Sequence[int]) -> int:
        p = self.roles.pipeline
        return sizes[self.roles.names.index(p)] if p else 1

    def training_state(self, sizes: Sequence[int], stages: int) -> int:
        """Parameters, gradients, accumulators, optimizer state and inputs per device on the mesh
        of axis sizes `sizes`, before a group is elaborated: on one stage exactly as
        `dslc.plan.memory` counts them (the weights as stored without a pipeline), on more a
        lower bound — each stage holds at
        least its 1/P share of everything, and the weight gradients a backward tick returns,
        as large as its gradients — so that a group whose state alone does not fit is ruled
        out safely."""
        mesh = self._mesh(sizes)
        program = replace(self.reference, mesh=mesh, pipeline=None)
        state = memory_state(program)
        inputs = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
        whole = state.params + state.grads + state.optimizer + state.accumulators
        if stages == 1:
            return whole + inputs
        return (whole + state.grads) // stages + inputs

    def _bound(self, group: _Group) -> float:
        """No candidate of the group is faster: the model's FLOPs spread evenly over the devices,
        stretched by its smallest bubble, plus the mesh's gradient reductions once known."""
        compute = self.model_flops / self.devices / self.hardware.device_flops
        return compute / (1 - group.bubble_floor) + self.sync.get(group.sizes, 0.0)

    # ---- costing --------------------------------------------------------------------------------

    def _mesh(self, sizes: Sequence[int]) -> Mesh:
        axes = zip(self.reference.mesh.axes, sizes, strict=True)
        return Mesh(tuple(MeshAxis(a.name, s, a.span, a.nodes) for a, s in axes))

    def _program(self, sizes: Sequence[int], virtual: int, schedule: str | None, microbatches: int | None) -> Program:
        """The spec elaborated on `sizes` with these pipeline settings, or the checker's first error."""
        module = self.module if schedule is None else _with_pipeline(self.module, schedule, microbatches, virtual)
        diags = Diagnostics()
        program = elaborate(module, tuple(sizes), diags, self.overrides)
        if program is not None and not diags.has_errors:
            check_program(program, diags)
        if program is None or diags.has_errors:
            raise _Rejected([d for d in diags.items if d.is_error])
        return program

    def _elaborate(self, group: _Group) -> _Costed | str:
        """The group elaborated, checked, and what its candidates' costs are made of; or why the
        checker rejects it."""
        schedule, microbatches = group.options[0]
        chunks = self._stages(group.sizes) * group.virtual
        shaping = tuple(s for a, s in zip(self.roles.names, group.sizes, strict=True) if a in self.roles.shaping)
        known = self.unsplittable.get(chunks) or self.misshapen.get(shaping) or self.illegal.get(group.sizes)
        if known:
            return known
        self.elaborated += 1
        try:
            program = self._program(group.sizes, group.virtual, schedule, microbatches)
        except _Rejected as exc:
            if any(d.code in CHUNKING for d in exc.errors):
                self.unsplittable[chunks] = str(exc)
            elif all(d.code in SHAPES for d in exc.errors):
                self.misshapen[shaping] = str(exc)
            else:
                self.illegal[group.sizes] = str(exc)
            return str(exc)
        intra = node_local_axes(program.mesh, self.roles.innermost_first(group.sizes), self.hardware.node_size)
        costed = _Costed(group, program, intra)
        # A bound: what the compute may hide is left out.
        hidden = self.hardware.overlap
        once = [t for t in costed.cost(schedule)[1] if t.phase not in PER_MICROBATCH and not (t.hideable and hidden)]
        self.sync[group.sizes] = step_time(0, once, 0.0, intra, self.hardware).communication
        return costed

    def _candidates(self, costed: _Costed) -> list[_Pending]:
        """Each (schedule, microbatches) option of the group, with its step time."""
        group = costed.group
        stages = self._stages(group.sizes)
        staged = costed.program.pipelined
        pending = []
        for schedule, microbatches in group.options:
            fig = None
            if staged and schedule is not None and microbatches is not None:
                fig = figures(cast(Kind, schedule), stages, microbatches, group.virtual)
            sends = self._sends(costed, microbatches, fig) if microbatches and fig else []
            bubble = fig.bubble_fraction if fig else 0.0
            transfers = (*costed.sliced(schedule, microbatches), *sends)
            time = step_time(costed.cost(schedule)[0], transfers, bubble, costed.intra, self.hardware)
            pending.append(_Pending(costed, schedule, microbatches, fig, time, sum(t.bytes for t in transfers)))
        self.costed += len(pending)
        return pending

    def _sends(self, costed: _Costed, microbatches: int, fig: Figures) -> list[Transfer]:
        """The pipeline executor's sends, as `communication` counts them: a buffer (a microbatch
        at the widest stage boundary) to both neighbours every tick."""
        program = costed.program
        assert program.pipeline is not None
        accumulate = program.train.accumulate
        stages = program.stages
        count = sends_per_tick(stages) * fig.ticks * accumulate
        boundary = costed.boundary(microbatches * accumulate)
        sent = ring_bytes("ppermute", stages, boundary) * count
        return [Transfer("ppermute", (program.pipeline.axis,), "pipeline", sent, count)] if sent else []

    def _judge(self, pending: _Pending) -> Candidate:
        """Count the candidate's memory (only what the group needs without activations, when that
        alone does not fit); check it with the checker when it fits."""
        costed = pending.costed
        group = costed.group
        exact = costed.base_memory <= self.device_memory
        total = self._memory(pending) if exact else costed.base_memory
        fits = total <= self.device_memory
        rejected = None
        if fits:
            diags = Diagnostics()
            check_program(pending.program, diags)
            rejected = next((f"{d.code}: {d.message}" for d in diags.items if d.is_error), None)
        return Candidate(
            group.sizes,
            pending.schedule,
            pending.microbatches,
            group.virtual,
            pending.time,
            pending.sent,
            total,
            exact,
            fits,
            rejected,
        )

    def _memory(self, pending: _Pending) -> int:
        """The memory `dslc.plan.memory` counts for the candidate: under a pipeline, its
        schedule's (the stash and receive slots, one chunk's backward, and how its placement
        stores the weights); without one, the same for every option."""
        if pending.figures is None or pending.microbatches is None:
            return pending.costed.planned.total
        return memory(pending.program).total


def _plannable(kind: str, stages: int, microbatches: int, virtual: int) -> bool:
    """Whether the planner can count this schedule: a closed form, or a table small enough to
    build (v-half has no closed form)."""
    try:
        figures(cast(Kind, kind), stages, microbatches, virtual)
    except ScheduleError:
        return False
    return True


class _Rejected(Exception):
    """The checker's errors on a group."""

    def __init__(self, errors: list[Diagnostic]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(f"{first.code}: {first.message}")


def _with_pipeline(module: ast.Module, schedule: str, microbatches: int | None, virtual: int) -> ast.Module:
    """The syntax tree with its `pipeline` section's settings replaced (spans kept, so that a
    diagnostic points at the section)."""
    items = []
    for item in module.items:
        if isinstance(item, ast.PipelineDef):
            at: Span = item.span
            settings: list[ast.Setting | ast.ScheduleSetting] = [ast.ScheduleSetting(ast.Ident(schedule, at), at)]
            for key, value in (("microbatches", microbatches), ("virtual", virtual)):
                if value is not None:
                    settings.append(ast.Setting(ast.Ident(key, at), (ast.IntLit(value, str(value), at),), at))
            item = replace(item, items=tuple(settings))
        items.append(item)
    return replace(module, items=tuple(items))
