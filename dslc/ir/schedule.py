"""The spec's pipeline schedule: its table, its figures and where its chunks live.

A schedule is a built-in kind (`build` makes its table) or a table read from a file (the IR
carries it). The planner reads only figures — closed forms for the built-in kinds that have
them, so that a pipeline of any size is planned in milliseconds — and the placement; the
executor and the generated module need the whole table.
"""

from __future__ import annotations

import functools

from dslc.ir.nodes import Program
from dslc.schedules import SPLIT_BACKWARD, Op, Schedule, build, placement
from dslc.schedules.figures import Figures, figures, table_figures


def schedule_table(program: Program) -> Schedule:
    """The pipeline's table: the one read from a file, or the kind's, built. `ScheduleError`
    for one larger than `MAX_ACTIONS` (the checker refuses to run those)."""
    p = program.pipeline
    assert p is not None, "a pipelined program"
    if p.table is not None:
        return p.table
    return build(p.schedule, program.stages, p.microbatches, p.virtual)


def pipeline_figures(program: Program) -> Figures | None:
    """What the planner reads from the schedule; None when the program is not pipelined.
    `ScheduleError` for a table too large to build where the kind has no closed form (the
    checker reports it)."""
    p = program.pipeline
    if p is None or not program.pipelined:
        return None
    if p.table is not None:
        return _table_figures(p.table)
    return figures(p.schedule, program.stages, p.microbatches, p.virtual)


@functools.lru_cache(maxsize=16)
def _table_figures(schedule: Schedule) -> Figures:
    return table_figures(schedule)


def stage_of(program: Program) -> tuple[int, ...]:
    """The stage that runs each chunk, as the schedule places it."""
    p = program.pipeline
    if p is None:
        return tuple(0 for _ in program.chunks)
    if p.table is not None:
        return p.table.placement
    return placement(p.schedule, program.stages, p.virtual)


def splits_backward(program: Program) -> bool:
    """Whether the pipeline's table splits each backward into I and W."""
    p = program.pipeline
    if p is None or not program.pipelined:
        return False
    if p.table is not None:
        return any(a.op is Op.INPUT_GRAD for row in p.table.actions_by_stage for a in row)
    return p.schedule in SPLIT_BACKWARD


def microbatch_slices(program: Program) -> int:
    """How many slices of the batch a step runs its layers on, one after another: pipeline
    microbatches (when the executor runs) times accumulation steps."""
    microbatches = program.pipeline.microbatches if program.pipelined and program.pipeline else 1
    return microbatches * program.train.accumulate
