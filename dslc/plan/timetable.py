"""The spec's pipeline schedule and its buffer plan, built once per plan.

Building and validating a table is the planner's slowest step (192 microbatches on 16
stages is a few hundred thousand checks), and memory, communication and the report all
read it.
"""

from __future__ import annotations

import functools

from dslc.ir.nodes import Program
from dslc.schedules import Schedule, build
from dslc.schedules.buffers import ExecutionPlan, allocate_slots


@functools.lru_cache(maxsize=16)
def _timetable(kind: str, stages: int, microbatches: int, virtual: int) -> tuple[Schedule, ExecutionPlan]:
    schedule = build(kind, stages, microbatches, virtual)
    return schedule, allocate_slots(schedule)


def timetable(program: Program) -> tuple[Schedule, ExecutionPlan] | None:
    """The schedule table and its buffer slots; None when the program is not pipelined."""
    p = program.pipeline
    if p is None or not pipelined(program):
        return None
    return _timetable(p.schedule, program.mesh.size((p.axis,)), p.microbatches, p.virtual)


def pipelined(program: Program) -> bool:
    """Whether the lowering runs the pipeline executor (more than one chunk in the table)."""
    p = program.pipeline
    return p is not None and program.mesh.size((p.axis,)) * p.virtual > 1


def microbatch_slices(program: Program) -> int:
    """How many slices of the batch a step runs its layers on, one after another: pipeline
    microbatches (when the executor runs) times accumulation steps."""
    microbatches = program.pipeline.microbatches if pipelined(program) and program.pipeline else 1
    return microbatches * program.train.accumulate
