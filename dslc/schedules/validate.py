"""Check a schedule table against the rules every pipeline schedule must obey.

The rules: the placement gives every stage `virtual` chunks and puts consecutive chunks on the
same or neighbouring stages, each action sits on the stage that holds its chunk, at most one
action per stage per tick, every (chunk, microbatch) runs exactly one forward and exactly one
backward (one B, or one I and one W), and every action comes strictly after the actions whose
results it consumes (`table.inputs`). A table that passes can run on the lockstep executor
without deadlock or stale data.
"""

from __future__ import annotations

from collections import Counter

from dslc.schedules.table import Action, Op, Result, Schedule, Value, direction, inputs, output


def validate(schedule: Schedule) -> list[str]:
    """Every broken rule in `schedule`, one message each; empty when the table is valid."""
    problems = _check_shape(schedule)
    if problems:
        # Positions and counts mean nothing until the dimensions do.
        return problems
    placed = _check_placement(schedule, problems)
    _check_counts(schedule, placed, problems)
    _check_dependencies(schedule, placed, problems)
    return problems


def _check_shape(schedule: Schedule) -> list[str]:
    problems = [
        f"{name} must be at least 1, got {value}"
        for name, value in (
            ("stages", schedule.stages),
            ("microbatches", schedule.microbatches),
            ("virtual", schedule.virtual),
        )
        if value < 1
    ]
    if len(schedule.actions_by_stage) != schedule.stages:
        problems.append(
            f"the table needs one row per stage ({schedule.stages}), it has {len(schedule.actions_by_stage)}"
        )
    if not problems:
        problems += _check_holders(schedule)
    return problems


def _check_holders(schedule: Schedule) -> list[str]:
    """The placement: one stage per chunk, `virtual` chunks per stage, neighbours in turn."""
    placement, stages = schedule.placement, schedule.stages
    if len(placement) != schedule.chunks:
        return [
            f"the placement names the stage of {len(placement)} chunks; {schedule.stages} stages x "
            f"{schedule.virtual} virtual make {schedule.chunks}"
        ]
    problems = [
        f"chunk {chunk} is placed on stage {stage}, outside 0..{stages - 1}"
        for chunk, stage in enumerate(placement)
        if not 0 <= stage < stages
    ]
    if problems:
        return problems
    for stage in range(stages):
        held = schedule.chunks_of(stage)
        if len(held) != schedule.virtual:
            problems.append(
                f"stage {stage} holds {len(held)} chunks ({', '.join(map(str, held)) or 'none'}); "
                f"every stage holds virtual={schedule.virtual}"
            )
    for chunk in range(schedule.chunks - 1):
        source, target = placement[chunk], placement[chunk + 1]
        if direction(Result.ACTIVATION, source, target, stages) is None:
            problems.append(
                f"chunk {chunk} on stage {source} hands its output to chunk {chunk + 1} on stage {target}, "
                "which is not a neighbour: values travel to the next stage, the previous one, or stay"
            )
    return problems


def _check_placement(schedule: Schedule, problems: list[str]) -> list[Action]:
    """Check where each action sits; return the actions whose chunk and microbatch exist."""
    placed = []
    last_tick = -1
    for stage, row in enumerate(schedule.actions_by_stage):
        previous: Action | None = None
        for action in row:
            where = f"stage {stage}, tick {action.tick}: {_name(action)}"
            if action.stage != stage:
                problems.append(f"{where} is in stage {stage}'s row but says stage {action.stage}")
            if not 0 <= action.tick < schedule.ticks:
                problems.append(f"{where} is outside ticks 0..{schedule.ticks - 1}")
            if previous is not None and action.tick == previous.tick:
                problems.append(f"{where} shares the tick with {_name(previous)}; a stage runs one action per tick")
            elif previous is not None and action.tick < previous.tick:
                problems.append(
                    f"{where} is listed after {_name(previous)} at tick {previous.tick}; a stage's row is in tick order"
                )
            previous = action
            last_tick = max(last_tick, action.tick)
            if not 0 <= action.chunk < schedule.chunks:
                problems.append(f"{where} names a chunk outside 0..{schedule.chunks - 1}")
            elif not 0 <= action.microbatch < schedule.microbatches:
                problems.append(f"{where} names a microbatch outside 0..{schedule.microbatches - 1}")
            else:
                placed.append(action)
                if schedule.placement[action.chunk] != stage:
                    problems.append(
                        f"{where} runs on the wrong stage: chunk {action.chunk} lives on "
                        f"stage {schedule.placement[action.chunk]}"
                    )
    if last_tick + 1 != schedule.ticks:
        # Idle columns after the last action would inflate the bubble fraction.
        problems.append(f"ticks is {schedule.ticks} but the last action runs at tick {last_tick}")
    return placed


def _check_counts(schedule: Schedule, placed: list[Action], problems: list[str]) -> None:
    counts = Counter((action.op, action.chunk, action.microbatch) for action in placed)
    for chunk in range(schedule.chunks):
        for microbatch in range(schedule.microbatches):
            forwards, backwards, input_grads, weight_grads = (
                counts[op, chunk, microbatch] for op in (Op.FORWARD, Op.BACKWARD, Op.INPUT_GRAD, Op.WEIGHT_GRAD)
            )
            what = f"chunk {chunk}, microbatch {microbatch}"
            if forwards != 1:
                problems.append(f"{what} has {forwards} forwards (F), expected 1")
            whole = (backwards, input_grads, weight_grads) == (1, 0, 0)
            split = (backwards, input_grads, weight_grads) == (0, 1, 1)
            if not (whole or split):
                problems.append(
                    f"{what} has {backwards} B, {input_grads} I and {weight_grads} W; "
                    "expected one backward: 1 B, or 1 I and 1 W"
                )


def _check_dependencies(schedule: Schedule, placed: list[Action], problems: list[str]) -> None:
    ready_at: dict[Value, int] = {}
    for action in placed:
        produced = output(action.op, action.chunk, action.microbatch)
        # With duplicates (already reported) the earliest producer is the one that counts.
        if produced is not None and action.tick < ready_at.get(produced, action.tick + 1):
            ready_at[produced] = action.tick
    for action in placed:
        for value in inputs(action.op, action.chunk, action.microbatch, schedule.chunks):
            ready = ready_at.get(value)
            if ready is not None and ready < action.tick:
                continue
            where = f"stage {action.stage}, tick {action.tick}: {_name(action)}"
            if ready is None:
                problems.append(f"{where} needs the {value.describe()}, which nothing produces")
            else:
                problems.append(
                    f"{where} needs the {value.describe()}, produced at tick {ready}; "
                    f"it must be produced before tick {action.tick}"
                )


def _name(action: Action) -> str:
    return f"{action.op} of chunk {action.chunk}, microbatch {action.microbatch}"
