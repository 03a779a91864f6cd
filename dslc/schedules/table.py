"""A pipeline schedule as data: for every stage and every tick, at most one action.

Vocabulary. There are `stages` devices in the pipeline and `stages * virtual` model chunks in
model order. Which stage holds which chunk is part of the table, its `placement`: Megatron's
interleaved placement puts chunk `c` on stage `c % stages` (`ring_placement`); a V puts chunks
`d` and `2 * stages - 1 - d` on stage `d` (`v_placement`), so the model runs down the stages and
back up. Consecutive chunks sit on the same stage or on neighbouring ones (the stage after or
before, counting the last stage's neighbour as the first), because values only travel that far
between ticks. Every chunk runs a forward and a backward for every microbatch. The backward is
either one `B`, or split into `I` (the gradient with respect to the chunk's input, which the
previous chunk waits for) and `W` (the gradient with respect to the chunk's weights, which
nobody waits for and so can be deferred).

Time is counted in ticks. In the table every action takes exactly one tick, whatever its op:
the unit-time model, which is also how the generated program runs (in lockstep, one
`lax.switch` per tick). Results cross to the neighbouring stage (or stay on their own) between
ticks, so an action at tick `t` can consume anything produced at tick `t - 1` or earlier.
`dslc.schedules.cost` re-times the same per-stage order under other op costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final, assert_never

from dslc.runtime import schedule as kernel

# The largest table dslc builds or reads, in actions (stages x chunks per stage x microbatches
# x 2 ops, or 3 with a split backward): making, checking and allocating one takes about 25 us
# an action, so this is a few seconds. Bigger pipelines are planned from closed forms where
# their kind has them.
MAX_ACTIONS: Final = 1 << 18


class Op(StrEnum):
    """What a stage does with one (chunk, microbatch) in one tick."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    INPUT_GRAD = "I"  # the half of the backward the previous chunk waits for
    WEIGHT_GRAD = "W"  # the half nobody waits for


class Direction(StrEnum):
    """Where a value goes from the stage that made it: the stages form a ring, so the last
    stage's next is the first and the first stage's previous is the last."""

    NEXT = "next"  # to stage s + 1
    PREVIOUS = "previous"  # to stage s - 1
    SAME = "same"  # stays on stage s (a V's turn)


class Result(StrEnum):
    """A value one action leaves for another."""

    ACTIVATION = "activation"
    INPUT_GRADIENT = "input gradient"


@dataclass(frozen=True, slots=True)
class Value:
    """The `result` of a chunk on a microbatch: what dependencies are made of."""

    result: Result
    chunk: int
    microbatch: int

    def describe(self) -> str:
        """Words for messages, such as `activation of chunk 2, microbatch 0`."""
        return f"{self.result.value} of chunk {self.chunk}, microbatch {self.microbatch}"


def inputs(op: Op, chunk: int, microbatch: int, chunks: int) -> tuple[Value, ...]:
    """The values `op` on (`chunk`, `microbatch`) must wait for, in a model of `chunks` chunks.

    This is the one statement of the data dependencies; the generators wait on it and the
    validator checks it.
    """
    match op:
        case Op.FORWARD:
            if chunk == 0:
                return ()
            return (Value(Result.ACTIVATION, chunk - 1, microbatch),)
        case Op.BACKWARD | Op.INPUT_GRAD:
            own_activation = Value(Result.ACTIVATION, chunk, microbatch)
            if chunk == chunks - 1:
                # The loss sits at the end of the last chunk, so its gradient is local.
                return (own_activation,)
            return (own_activation, Value(Result.INPUT_GRADIENT, chunk + 1, microbatch))
        case Op.WEIGHT_GRAD:
            # W reuses the output gradient that I received, so it runs after I.
            return (Value(Result.INPUT_GRADIENT, chunk, microbatch),)
        case _:
            assert_never(op)


def output(op: Op, chunk: int, microbatch: int) -> Value | None:
    """The value `op` on (`chunk`, `microbatch`) leaves behind, if another action needs it."""
    match op:
        case Op.FORWARD:
            return Value(Result.ACTIVATION, chunk, microbatch)
        case Op.BACKWARD | Op.INPUT_GRAD:
            return Value(Result.INPUT_GRADIENT, chunk, microbatch)
        case Op.WEIGHT_GRAD:
            return None
        case _:
            assert_never(op)


def ring_placement(stages: int, virtual: int) -> tuple[int, ...]:
    """Chunk `c` on stage `c % stages`: one chunk per stage, or Megatron's interleaving."""
    return tuple(chunk % stages for chunk in range(stages * virtual))


def v_placement(stages: int) -> tuple[int, ...]:
    """Two chunks per stage in a V: stage `d` holds chunks `d` and `2 * stages - 1 - d`."""
    return tuple(chunk if chunk < stages else 2 * stages - 1 - chunk for chunk in range(2 * stages))


def direction(result: Result, source: int, target: int, stages: int) -> Direction | None:
    """How `result` travels from stage `source` to stage `target`; None when they are not
    neighbours (`dslc.runtime.schedule.direction`, which the executor's tables follow)."""
    way = kernel.direction(result, source, target, stages)
    return None if way is None else Direction(way)


@dataclass(frozen=True, slots=True)
class Action:
    """Stage `stage` runs `op` for `microbatch` on model chunk `chunk` during tick `tick`."""

    tick: int
    stage: int
    op: Op
    microbatch: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """The whole table: `actions_by_stage[s]` lists stage `s`'s actions in tick order, and
    `placement[c]` is the stage that holds chunk `c`.

    Ticks with no action on a stage are idle there. `ticks` is the makespan in unit ticks.
    Nothing here checks the table; `dslc.schedules.validate.validate` does.
    """

    kind: str
    stages: int
    microbatches: int
    virtual: int
    ticks: int
    actions_by_stage: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]

    @property
    def chunks(self) -> int:
        """Model chunks in the whole pipeline: `virtual` per stage."""
        return self.stages * self.virtual

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks `stage` holds, in model order."""
        return tuple(chunk for chunk, holder in enumerate(self.placement) if holder == stage)

    @property
    def idle_slots(self) -> int:
        """(stage, tick) slots with no action."""
        return self.stages * self.ticks - sum(len(row) for row in self.actions_by_stage)

    @property
    def bubble_fraction(self) -> float:
        """Idle slots over all stage × tick slots, in unit ticks (every op one tick).

        Every kind is measured this way, so they compare directly. For gpipe and 1f1b this is
        exactly (P-1)/(M+P-1). The split backward makes a zb-h1 microbatch three ticks against
        1f1b's two; `dslc.schedules.cost.retime` measures every kind with one backward costing
        two and gives the same fractions for the tables `build` makes.
        """
        # One integer division, so equal ratios give equal floats.
        return self.idle_slots / (self.stages * self.ticks)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per stage, the most (chunk, microbatch) activations held at once.

        An activation is held from its forward until the backward that consumes it (B or I).
        W still needs the chunk's input and output gradient, a smaller set that is not counted,
        as in the zero-bubble paper's memory accounting.
        """
        peaks = []
        for row in self.actions_by_stage:
            held = peak = 0
            for action in row:
                match action.op:
                    case Op.FORWARD:
                        held += 1
                    case Op.BACKWARD | Op.INPUT_GRAD:
                        held -= 1
                    case Op.WEIGHT_GRAD:
                        pass
                    case _:
                        assert_never(action.op)
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def grid(self) -> tuple[tuple[Action | None, ...], ...]:
        """The table as stage × tick, `None` where the stage is idle.

        Meant for a schedule that passes `validate`: with two actions in one slot, the later
        one in the row wins.
        """
        rows = []
        for row in self.actions_by_stage:
            cells: list[Action | None] = [None] * self.ticks
            for action in row:
                cells[action.tick] = action
            rows.append(tuple(cells))
        return tuple(rows)
