"""Re-timing a schedule under op costs other than one tick each.

The table gives every op one tick. Real ops differ: a whole backward costs about two forwards,
and its halves I and W about one each. `retime` runs each stage's actions in the table's order,
each as early as its stage and its inputs allow, with the durations `Costs` gives.

With the default costs (F = 1, B = 2, I = W = 1) every kind does the same three units of work
per chunk and microbatch, so the comparison between kinds with and without the split backward
is fair. For the tables `build` makes, the costed bubble fraction equals the unit-tick one:
(P-1)/(M+P-1) for gpipe and 1f1b, (P-1)/(VM+P-1) for interleaved-1f1b, and (P-1)/(3M+P-1) for
zb-h1 when M >= P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.schedules.table import Op, Schedule
from dslc.schedules.timing import Step, start_times


@dataclass(frozen=True, slots=True)
class Costs:
    """Duration of each op, in whole units of time (scale ratios such as 1:2.5 to 2:5)."""

    forward: int = 1
    backward: int = 2
    input_grad: int = 1
    weight_grad: int = 1

    def __post_init__(self) -> None:
        # A zero-length op would hand its result to a consumer starting at the same moment.
        if min(self.forward, self.backward, self.input_grad, self.weight_grad) < 1:
            raise ValueError(f"every op must cost at least one unit, got {self}")

    def of(self, op: Op) -> int:
        """How long `op` takes."""
        match op:
            case Op.FORWARD:
                return self.forward
            case Op.BACKWARD:
                return self.backward
            case Op.INPUT_GRAD:
                return self.input_grad
            case Op.WEIGHT_GRAD:
                return self.weight_grad
            case _:
                assert_never(op)


@dataclass(frozen=True, slots=True)
class Timing:
    """A schedule's order run under some `Costs`."""

    stages: int
    makespan: int
    busy: int  # summed over stages

    @property
    def bubble_fraction(self) -> float:
        """Idle time over stages × makespan, the table's definition under these costs."""
        return (self.stages * self.makespan - self.busy) / (self.stages * self.makespan)


def retime(schedule: Schedule, costs: Costs = Costs()) -> Timing:
    """Run `schedule`'s per-stage order with `costs`; `schedule` must pass `validate`."""
    programs = [
        [Step(action.op, action.chunk, action.microbatch) for action in row] for row in schedule.actions_by_stage
    ]
    starts = start_times(programs, schedule.chunks, costs.of)
    makespan = max(
        start + costs.of(step.op)
        for program, stage_starts in zip(programs, starts, strict=True)
        for step, start in zip(program, stage_starts, strict=True)
    )
    busy = sum(costs.of(step.op) for program in programs for step in program)
    return Timing(schedule.stages, makespan, busy)
