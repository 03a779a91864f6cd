"""The validator: every generated table passes, and every kind of corruption is caught."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from dslc.schedules import KINDS, V_KINDS, Action, Op, Schedule, build, validate

# No example database: these tests must leave nothing behind in the checkout.
fast = settings(max_examples=40, deadline=None, database=None)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, int, int, int]:
    """A (kind, stages, microbatches, virtual) that `build` accepts."""
    kind = draw(st.sampled_from(KINDS))
    stages = draw(st.integers(1, 8))
    if kind == "interleaved-1f1b":
        return kind, stages, stages * draw(st.integers(1, 3)), draw(st.integers(2, 3))
    return kind, stages, draw(st.integers(1, 20)), 2 if kind in V_KINDS else 1


schedules = requests().map(lambda request: build(*request))


def all_actions(schedule: Schedule) -> list[Action]:
    return [action for row in schedule.actions_by_stage for action in row]


def with_actions(schedule: Schedule, actions: list[Action], ticks: int | None = None) -> Schedule:
    """`schedule` with its table replaced by `actions`, each row sorted by tick."""
    rows = tuple(
        tuple(sorted((a for a in actions if a.stage == stage), key=lambda a: a.tick))
        for stage in range(schedule.stages)
    )
    return dataclasses.replace(schedule, actions_by_stage=rows, ticks=schedule.ticks if ticks is None else ticks)


def find(schedule: Schedule, ops: set[Op], chunk: int, microbatch: int) -> Action:
    [action] = [a for a in all_actions(schedule) if a.op in ops and a.chunk == chunk and a.microbatch == microbatch]
    return action


def mentions(problems: list[str], *fragments: str) -> bool:
    return any(all(fragment in problem for fragment in fragments) for problem in problems)


@fast
@given(requests())
def test_every_generated_table_is_valid(request: tuple[str, int, int, int]) -> None:
    schedule = build(*request)
    assert validate(schedule) == []
    grid = schedule.grid()
    assert len(grid) == schedule.stages
    assert all(len(row) == schedule.ticks for row in grid)
    assert sum(cell is not None for row in grid for cell in row) == len(all_actions(schedule))


@fast
@given(schedules, st.data())
def test_a_dropped_action_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    actions = all_actions(schedule)
    dropped = actions.pop(data.draw(st.integers(0, len(actions) - 1)))
    problems = validate(with_actions(schedule, actions))
    assert mentions(problems, f"chunk {dropped.chunk}, microbatch {dropped.microbatch} has")


@fast
@given(schedules, st.data())
def test_a_duplicated_action_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    actions = all_actions(schedule)
    original = data.draw(st.sampled_from(actions))
    busy = {a.tick for a in schedule.actions_by_stage[original.stage]}
    idle = [tick for tick in range(schedule.ticks) if tick not in busy]
    # Put the copy in an idle slot of the same stage, or one tick past the end.
    tick = data.draw(st.sampled_from(idle)) if idle else schedule.ticks
    copy = dataclasses.replace(original, tick=tick)
    problems = validate(with_actions(schedule, [*actions, copy], max(tick + 1, schedule.ticks)))
    assert mentions(problems, f"chunk {original.chunk}, microbatch {original.microbatch} has")


@fast
@given(schedules, st.data())
def test_a_backward_swapped_with_its_forward_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    chunk = data.draw(st.integers(0, schedule.chunks - 1))
    microbatch = data.draw(st.integers(0, schedule.microbatches - 1))
    forward = find(schedule, {Op.FORWARD}, chunk, microbatch)
    backward = find(schedule, {Op.BACKWARD, Op.INPUT_GRAD}, chunk, microbatch)
    swapped = {
        forward: dataclasses.replace(forward, tick=backward.tick),
        backward: dataclasses.replace(backward, tick=forward.tick),
    }
    problems = validate(with_actions(schedule, [swapped.get(a, a) for a in all_actions(schedule)]))
    # Same stage, same two ticks: only the order of data is wrong.
    assert mentions(
        problems,
        f"{backward.op} of chunk {chunk}, microbatch {microbatch} needs the activation of chunk "
        f"{chunk}, microbatch {microbatch}, produced at tick {backward.tick}",
    )


@fast
@given(schedules.filter(lambda s: s.chunks > 1), st.data())
def test_forwards_swapped_across_stages_are_caught(schedule: Schedule, data: st.DataObject) -> None:
    chunk = data.draw(st.integers(0, schedule.chunks - 2))
    microbatch = data.draw(st.integers(0, schedule.microbatches - 1))
    first = find(schedule, {Op.FORWARD}, chunk, microbatch)
    second = find(schedule, {Op.FORWARD}, chunk + 1, microbatch)
    swapped = {
        first: dataclasses.replace(first, tick=second.tick),
        second: dataclasses.replace(second, tick=first.tick),
    }
    problems = validate(with_actions(schedule, [swapped.get(a, a) for a in all_actions(schedule)]))
    assert mentions(
        problems,
        f"F of chunk {chunk + 1}, microbatch {microbatch} needs the activation of chunk {chunk}",
    )


@fast
@given(schedules.filter(lambda s: s.kind in ("zb-h1", *V_KINDS)), st.data())
def test_a_weight_gradient_before_its_input_gradient_is_caught(schedule: Schedule, data: st.DataObject) -> None:
    microbatch = data.draw(st.integers(0, schedule.microbatches - 1))
    chunk = data.draw(st.integers(0, schedule.chunks - 1))
    input_grad = find(schedule, {Op.INPUT_GRAD}, chunk, microbatch)
    weight_grad = find(schedule, {Op.WEIGHT_GRAD}, chunk, microbatch)
    swapped = {
        input_grad: dataclasses.replace(input_grad, tick=weight_grad.tick),
        weight_grad: dataclasses.replace(weight_grad, tick=input_grad.tick),
    }
    problems = validate(with_actions(schedule, [swapped.get(a, a) for a in all_actions(schedule)]))
    assert mentions(problems, f"W of chunk {chunk}, microbatch {microbatch} needs the input grad")


def test_a_backward_before_the_next_chunks_backward_is_caught() -> None:
    schedule = build("1f1b", 2, 2)
    late = find(schedule, {Op.BACKWARD}, 1, 0)
    # Stage 0 runs its B for microbatch 0 in the same tick stage 1 does: too early.
    actions = [
        dataclasses.replace(a, tick=late.tick) if (a.op, a.chunk, a.microbatch) == (Op.BACKWARD, 0, 0) else a
        for a in all_actions(schedule)
    ]
    problems = validate(with_actions(schedule, actions))
    assert mentions(problems, "B of chunk 0, microbatch 0 needs the input gradient of chunk 1")


def test_two_actions_in_one_tick_are_caught() -> None:
    schedule = build("gpipe", 2, 2)
    first, second = schedule.actions_by_stage[0][:2]
    rows = ((first, dataclasses.replace(second, tick=first.tick)), schedule.actions_by_stage[1])
    problems = validate(dataclasses.replace(schedule, actions_by_stage=rows))
    assert mentions(problems, "stage 0, tick 0: F of chunk 0, microbatch 1 shares the tick")


def test_a_row_out_of_tick_order_is_caught() -> None:
    schedule = build("gpipe", 2, 2)
    row = schedule.actions_by_stage[0]
    rows = ((row[1], row[0], *row[2:]), schedule.actions_by_stage[1])
    problems = validate(dataclasses.replace(schedule, actions_by_stage=rows))
    assert mentions(problems, "is listed after", "tick order")


def test_an_action_on_the_wrong_stage_is_caught() -> None:
    schedule = build("1f1b", 2, 2)
    moved = find(schedule, {Op.FORWARD}, 0, 1)
    actions = [dataclasses.replace(a, stage=1, tick=schedule.ticks) if a == moved else a for a in all_actions(schedule)]
    problems = validate(with_actions(schedule, actions, schedule.ticks + 1))
    assert mentions(problems, "F of chunk 0, microbatch 1 runs on the wrong stage")


def test_an_action_in_the_wrong_row_is_caught() -> None:
    schedule = build("1f1b", 2, 2)
    first, *rest = schedule.actions_by_stage[0]
    rows = ((dataclasses.replace(first, stage=1), *rest), schedule.actions_by_stage[1])
    problems = validate(dataclasses.replace(schedule, actions_by_stage=rows))
    assert mentions(problems, "in stage 0's row but says stage 1")


def test_mixing_a_whole_backward_with_a_split_one_is_caught() -> None:
    schedule = build("1f1b", 2, 2)
    actions = [
        dataclasses.replace(a, op=Op.INPUT_GRAD) if (a.op, a.chunk, a.microbatch) == (Op.BACKWARD, 1, 1) else a
        for a in all_actions(schedule)
    ]
    problems = validate(with_actions(schedule, actions))
    assert mentions(problems, "chunk 1, microbatch 1 has 0 B, 1 I and 0 W")


def test_out_of_range_chunks_and_microbatches_are_caught() -> None:
    schedule = build("1f1b", 2, 2)
    first, *rest = schedule.actions_by_stage[0]
    for bad in (dataclasses.replace(first, chunk=2), dataclasses.replace(first, microbatch=-1)):
        rows = ((bad, *rest), schedule.actions_by_stage[1])
        problems = validate(dataclasses.replace(schedule, actions_by_stage=rows))
        assert mentions(problems, "names a")
        assert mentions(problems, "chunk 0, microbatch 0 has 0 forwards")


def test_trailing_idle_ticks_are_caught() -> None:
    schedule = build("1f1b", 2, 2)
    problems = validate(dataclasses.replace(schedule, ticks=schedule.ticks + 1))
    assert problems == ["ticks is 7 but the last action runs at tick 5"]


def test_a_missing_row_and_bad_dimensions_are_caught() -> None:
    schedule = build("1f1b", 2, 2)
    problems = validate(dataclasses.replace(schedule, actions_by_stage=schedule.actions_by_stage[:1]))
    assert problems == ["the table needs one row per stage (2), it has 1"]
    problems = validate(dataclasses.replace(schedule, microbatches=0, virtual=0))
    assert problems == [
        "microbatches must be at least 1, got 0",
        "virtual must be at least 1, got 0",
    ]


def test_the_placement_decides_where_a_chunk_runs() -> None:
    """The same actions are right under one placement and wrong under another."""
    schedule = build("interleaved-1f1b", 2, 2, 2)
    assert schedule.placement == (0, 1, 0, 1)
    problems = validate(dataclasses.replace(schedule, placement=(0, 1, 1, 0)))
    assert mentions(problems, "F of chunk 2, microbatch 0 runs on the wrong stage: chunk 2 lives on stage 1")


def test_a_bad_placement_is_caught_before_the_actions() -> None:
    schedule = build("interleaved-1f1b", 4, 4, 2)
    cases = {
        (0, 1, 2, 3): ["the placement names the stage of 4 chunks; 4 stages x 2 virtual make 8"],
        (0, 1, 2, 3, 0, 1, 2, 9): ["chunk 7 is placed on stage 9, outside 0..3"],
        (0, 1, 2, 3, 3, 2, 1, 1): [
            "stage 0 holds 1 chunks (0); every stage holds virtual=2",
            "stage 1 holds 3 chunks (1, 6, 7); every stage holds virtual=2",
        ],
        # Chunk 5 on stage 0 to chunk 6 on stage 3 is fine: the stages form a ring.
        (0, 1, 2, 3, 1, 0, 3, 2): [
            "chunk 3 on stage 3 hands its output to chunk 4 on stage 1, which is not a neighbour: "
            "values travel to the next stage, the previous one, or stay"
        ],
    }
    for placement, expected in cases.items():
        assert validate(dataclasses.replace(schedule, placement=placement)) == expected, placement
