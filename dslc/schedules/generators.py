"""One generator per schedule kind: the per-stage order of steps, timed in unit ticks.

Each generator writes down what every stage runs, in order, and `timing.start_times` places
each step at the first tick its stage is free and its inputs have arrived. Arguments are
assumed checked (`dslc.schedules.build` does that for users).
"""

from __future__ import annotations

from collections.abc import Sequence

from dslc.schedules.table import Action, Op, Schedule, ring_placement
from dslc.schedules.timing import Step, start_times


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every stage runs all its forwards, then all its backwards."""
    programs = [
        [Step(Op.FORWARD, stage, m) for m in range(microbatches)]
        + [Step(Op.BACKWARD, stage, m) for m in range(microbatches)]
        for stage in range(stages)
    ]
    return _tabulate("gpipe", stages, microbatches, 1, programs)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then alternate one forward and one backward.

    Stage `s` holds at most `stages - s` activations, against GPipe's `microbatches`, for
    the same makespan.
    """
    programs = [_one_forward_one_backward(stage, stages, microbatches, Op.BACKWARD) for stage in range(stages)]
    return _tabulate("1f1b", stages, microbatches, 1, programs)


def interleaved_1f1b(stages: int, microbatches: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: `virtual` chunks per stage, microbatches in groups of `stages`.

    Stage `s` holds chunks `s, s + stages, ...`. Its k-th forward is on microbatch group
    `k // (stages * virtual)`, local chunk `(k // stages) % virtual`; backwards visit the local
    chunks in reverse. Needs `microbatches % stages == 0` so every group is full.
    """
    assert microbatches % stages == 0, "build checks this"
    steps_per_pass = microbatches * virtual

    def step(op: Op, stage: int, k: int) -> Step:
        local_chunk = (k // stages) % virtual
        if op is Op.BACKWARD:
            local_chunk = virtual - 1 - local_chunk
        microbatch = (k // (stages * virtual)) * stages + k % stages
        return Step(op, local_chunk * stages + stage, microbatch)

    programs: list[list[Step]] = []
    for stage in range(stages):
        # Megatron's warm-up: enough forwards to cover the first group's trip through every
        # later chunk and back to this stage, so the steady state finds a backward ready.
        warmup = min(2 * (stages - 1 - stage) + (virtual - 1) * stages, steps_per_pass)
        program = [step(Op.FORWARD, stage, k) for k in range(warmup)]
        for k in range(steps_per_pass - warmup):
            program += [step(Op.FORWARD, stage, warmup + k), step(Op.BACKWARD, stage, k)]
        program += [step(Op.BACKWARD, stage, k) for k in range(steps_per_pass - warmup, steps_per_pass)]
        programs.append(program)
    return _tabulate("interleaved-1f1b", stages, microbatches, virtual, programs)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """Zero-bubble H1 (Qi et al., 2023): 1F1B's order with B split into I and a deferred W.

    The F and I order is 1F1B's, so the activations held are the same. Stage `s` runs each W
    `s` microbatches behind its I: later stages get their last input gradient earlier and
    keep more W's for the tail, where stage `s` runs `s + 1` of them while the last I's travel
    back to stage 0. With `microbatches >= stages` this takes 3M + P - 1 ticks.
    """
    programs: list[list[Step]] = []
    for stage in range(stages):
        program: list[Step] = []
        for step in _one_forward_one_backward(stage, stages, microbatches, Op.INPUT_GRAD):
            program.append(step)
            if step.op is Op.INPUT_GRAD and step.microbatch >= stage:
                program.append(Step(Op.WEIGHT_GRAD, stage, step.microbatch - stage))
        program += [Step(Op.WEIGHT_GRAD, stage, m) for m in range(max(0, microbatches - stage), microbatches)]
        programs.append(program)
    return _tabulate("zb-h1", stages, microbatches, 1, programs)


def _one_forward_one_backward(stage: int, stages: int, microbatches: int, backward: Op) -> list[Step]:
    # Enough warm-up forwards to keep the later stages busy until the first backward returns.
    warmup = min(stages - 1 - stage, microbatches)
    program = [Step(Op.FORWARD, stage, m) for m in range(warmup)]
    for m in range(microbatches):
        # Steady state: one forward, then one backward; once the forwards run out, the
        # remaining backwards are the cool-down.
        if warmup + m < microbatches:
            program.append(Step(Op.FORWARD, stage, warmup + m))
        program.append(Step(backward, stage, m))
    return program


def _tabulate(
    kind: str,
    stages: int,
    microbatches: int,
    virtual: int,
    programs: Sequence[Sequence[Step]],
) -> Schedule:
    placement = ring_placement(stages, virtual)
    starts = start_times(programs, len(placement), duration=lambda _op: 1)
    actions_by_stage = tuple(
        tuple(
            Action(tick, stage, step.op, step.microbatch, step.chunk)
            for step, tick in zip(program, stage_starts, strict=True)
        )
        for stage, (program, stage_starts) in enumerate(zip(programs, starts, strict=True))
    )
    ticks = 1 + max(row[-1].tick for row in actions_by_stage)
    return Schedule(kind, stages, microbatches, virtual, ticks, actions_by_stage, placement)
