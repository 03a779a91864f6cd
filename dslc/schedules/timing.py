"""When each step of a per-stage program starts.

Every schedule kind is first an order: for each stage, the list of steps it runs, as in
Megatron's loops and `torch.distributed.pipelining`'s per-rank action lists. A stage runs its
list in order and starts each step as soon as the stage is free and the step's inputs exist,
which is what a runtime with blocking receives does. The same order, timed with different op
costs, gives the unit-tick table (`generators`) and the costed re-timing (`cost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dslc.schedules.table import Op, Value, inputs, output


@dataclass(frozen=True, slots=True)
class Step:
    """One entry of a stage's program: an action not yet placed in time."""

    op: Op
    chunk: int
    microbatch: int


def start_times(
    programs: Sequence[Sequence[Step]], chunks: int, duration: Callable[[Op], int]
) -> tuple[tuple[int, ...], ...]:
    """The start time of every step, per stage, in the order of `programs`.

    A result is available from the moment its step ends, so with unit durations a step at tick
    `t` sees only what ended by `t`, i.e. what ran at tick `t - 1` or earlier.
    """
    finished: dict[Value, int] = {}
    starts: list[list[int]] = [[] for _ in programs]
    free_at = [0] * len(programs)
    remaining = sum(len(program) for program in programs)
    while remaining:
        progressed = False
        for stage, program in enumerate(programs):
            while len(starts[stage]) < len(program):
                step = program[len(starts[stage])]
                needed = inputs(step.op, step.chunk, step.microbatch, chunks)
                if any(value not in finished for value in needed):
                    break
                # A step's start depends only on steps placed before it, so visiting the
                # stages in any order gives the same times.
                start = max([free_at[stage], *(finished[value] for value in needed)])
                free_at[stage] = start + duration(step.op)
                produced = output(step.op, step.chunk, step.microbatch)
                if produced is not None:
                    finished[produced] = free_at[stage]
                starts[stage].append(start)
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [
                program[len(done)] for program, done in zip(programs, starts, strict=True) if len(done) < len(program)
            ]
            raise RuntimeError(f"internal error: stage programs deadlock, blocked at {blocked}")
    return tuple(tuple(stage_starts) for stage_starts in starts)
