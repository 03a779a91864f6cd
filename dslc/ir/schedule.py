"""The spec's pipeline schedule, resolved: one object that answers every question about it.

A schedule is a built-in kind on this pipeline (`BuiltInSchedule`: its table built when asked,
its figures in closed form where the kind has them, so that a pipeline of any size is planned
in milliseconds) or a table read from a file (`TableSchedule`, which the IR carries). Both
answer the same questions — the table, the figures, where each chunk lives, whether backward
passes split, the published bubble, the table's size — so what reads a schedule asks
`schedule_of(program)` and never which of the two it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dslc.ir.nodes import Pipeline, Program
from dslc.schedules import (
    SPLIT_BACKWARD,
    Op,
    Schedule,
    build,
    check_arguments,
    placement,
    table_actions,
    theoretical_bubble,
)
from dslc.schedules.figures import Figures, figures, table_figures


@dataclass(frozen=True, slots=True)
class BuiltInSchedule:
    """A built-in kind (`1f1b`, `zb-v`, ...) on `stages` stages. Its methods raise
    `ScheduleError` for arguments the kind cannot take (the checker reports them)."""

    kind: str
    stages: int
    microbatches: int
    virtual: int

    def table(self) -> Schedule:
        """The whole table, built (`ScheduleError` past `MAX_ACTIONS`: the checker refuses to
        run those)."""
        return build(self.kind, self.stages, self.microbatches, self.virtual)

    def figures(self) -> Figures:
        return figures(self.kind, self.stages, self.microbatches, self.virtual)

    def placement(self) -> tuple[int, ...]:
        """The stage that holds each chunk."""
        return placement(self.kind, self.stages, self.virtual)

    @property
    def splits_backward(self) -> bool:
        """Whether each backward runs as two ops, I (input gradient) and W (weight gradient)."""
        return self.kind in SPLIT_BACKWARD

    def theoretical_bubble(self) -> float | None:
        """The published closed-form bubble fraction, where the kind has one."""
        return theoretical_bubble(self.kind, self.stages, self.microbatches, self.virtual)

    def actions(self) -> int:
        """How many actions the table has, without building it."""
        kind, virtual = check_arguments(self.kind, self.stages, self.microbatches, self.virtual)
        return table_actions(kind, self.stages, self.microbatches, virtual)


@dataclass(frozen=True, slots=True)
class TableSchedule:
    """A table read from a file, already checked against this pipeline's stages and
    microbatches."""

    read: Schedule

    def table(self) -> Schedule:
        return self.read

    def figures(self) -> Figures:
        return _table_figures(self.read)

    def placement(self) -> tuple[int, ...]:
        return self.read.placement

    @property
    def splits_backward(self) -> bool:
        return any(a.op is Op.INPUT_GRAD for row in self.read.actions_by_stage for a in row)

    def theoretical_bubble(self) -> float | None:
        return None  # a table of the user's own has no published figure

    def actions(self) -> int:
        return sum(len(row) for row in self.read.actions_by_stage)


ResolvedSchedule = BuiltInSchedule | TableSchedule


def resolved(pipeline: Pipeline, stages: int) -> ResolvedSchedule:
    """`pipeline`'s schedule on `stages` stages: its table from a file, or its kind's."""
    if pipeline.table is not None:
        return TableSchedule(pipeline.table)
    return BuiltInSchedule(pipeline.schedule, stages, pipeline.microbatches, pipeline.virtual)


def schedule_of(program: Program) -> ResolvedSchedule:
    """The schedule of a pipelined program."""
    assert program.pipeline is not None, "a pipelined program"
    return resolved(program.pipeline, program.stages)


@functools.lru_cache(maxsize=16)
def _table_figures(schedule: Schedule) -> Figures:
    return table_figures(schedule)


def pipeline_figures(program: Program) -> Figures | None:
    """What the planner reads from the schedule; None when the program is not pipelined.
    `ScheduleError` for a table too large to build where the kind has no closed form (the
    checker reports it)."""
    return schedule_of(program).figures() if program.pipelined else None


def stage_of(program: Program) -> tuple[int, ...]:
    """The stage that runs each chunk, as the schedule places it."""
    if program.pipeline is None:
        return tuple(0 for _ in program.chunks)
    return schedule_of(program).placement()


def splits_backward(program: Program) -> bool:
    """Whether the pipeline's table splits each backward into I and W."""
    return program.pipelined and schedule_of(program).splits_backward


def microbatch_slices(program: Program) -> int:
    """How many slices of the batch a step runs its layers on, one after another: pipeline
    microbatches (when the executor runs) times accumulation steps."""
    microbatches = program.pipeline.microbatches if program.pipelined and program.pipeline else 1
    return microbatches * program.train.accumulate
