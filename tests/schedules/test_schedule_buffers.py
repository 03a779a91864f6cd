"""The executor's buffer plan: every value is where the plan says when it is read, and no
slot is reused while its value is still needed; and the timelines a generated module states
give back the very tables."""

from __future__ import annotations

import pytest

from dslc.runtime.schedule import (
    BACKWARD,
    FORWARD,
    IDLE,
    INPUT_GRAD,
    OTHER_DIRECTIONS,
    TABLE_ENTRIES,
    WEIGHT_GRAD,
    schedule_tables,
)
from dslc.schedules import KINDS, V_KINDS, Schedule, ScheduleError, build, to_json
from dslc.schedules.buffers import ExecutionPlan, allocate_slots
from dslc.schedules.from_json import table_from_json
from dslc.schedules.notation import timelines


def replay(p: ExecutionPlan, placement: tuple[int, ...]) -> None:
    """Run the plan on labels instead of tensors and check every read finds the right one.

    Each stage's value goes both ways round the ring and stays home too, as an executor may
    send it; the receive tables must keep exactly the one copy addressed to them."""
    stages, chunks = p.stages, len(placement)
    stash = [dict[int, tuple[int, int]]() for _ in range(stages)]
    acts = [dict[int, tuple[int, int]]() for _ in range(stages)]
    grads = [dict[int, tuple[int, int]]() for _ in range(stages)]
    for t in range(p.ticks):
        # What each stage made this tick: ("activation" or "gradient", (chunk it is for, m)).
        made: list[tuple[str, tuple[int, int]] | None] = [None] * stages
        for s in range(stages):
            op, m, c = p.op[t][s], p.microbatch[t][s], p.chunk[t][s]
            if op == IDLE:
                continue
            assert placement[c] == s
            if op == FORWARD:
                if c > 0:
                    assert acts[s].get(p.activation_slot[t][s]) == (c, m), (t, s, c, m)
                stash[s][p.stash_slot[t][s]] = (c, m)
                made[s] = ("activation", (c + 1, m)) if c < chunks - 1 else None
            else:
                assert stash[s].get(p.stash_slot[t][s]) == (c, m), (t, s, op, c, m)
                if c < chunks - 1:
                    assert grads[s].get(p.gradient_slot[t][s]) == (c, m), (t, s, op, c, m)
                if op in (BACKWARD, INPUT_GRAD):
                    made[s] = ("gradient", (c - 1, m)) if c > 0 else None
        delivered = [0] * stages
        others = p.other_directions
        for s in range(stages):
            arrivals = (
                ((s - 1) % stages, "activation", p.receive_activation, acts),
                ((s + 1) % stages, "gradient", p.receive_gradient, grads),
                ((s + 1) % stages, "activation", others.activation_from_next, acts),
                ((s - 1) % stages, "gradient", others.gradient_from_previous, grads),
                (s, "activation", others.keep_activation, acts),
                (s, "gradient", others.keep_gradient, grads),
            )
            for sender, kind, table, buffers in arrivals:
                slot = table[t][s]
                if slot < 0:
                    continue
                value = made[sender]
                assert value is not None and value[0] == kind, (t, s, kind, value)
                assert placement[value[1][0]] == s
                buffers[s][slot] = value[1]
                delivered[sender] += 1
        # Every value made reaches exactly one stage.
        assert delivered == [int(value is not None) for value in made], (t, delivered, made)


CASES = [(k, P, M, V) for k in KINDS for P in (1, 2, 3, 4) for M in (1, 2, 4, 8) for V in (1, 2)]


@pytest.mark.parametrize(("kind", "stages", "microbatches", "virtual"), CASES)
def test_replaying_the_plan_finds_every_value_in_its_slot(
    kind: str, stages: int, microbatches: int, virtual: int
) -> None:
    try:
        schedule = build(kind, stages, microbatches, virtual)
    except ScheduleError:
        return
    replay(allocate_slots(schedule), schedule.placement)


def test_stash_is_sized_by_the_schedule_not_by_the_microbatches() -> None:
    for m in (4, 8, 16):
        assert allocate_slots(build("gpipe", 2, m)).stash_slots == m
        assert allocate_slots(build("1f1b", 2, m)).stash_slots == 2
        assert allocate_slots(build("zb-h1", 2, m)).stash_slots == 2
    assert allocate_slots(build("1f1b", 4, 8)).stash_slots == max(build("1f1b", 4, 8).peak_in_flight) == 4
    interleaved = build("interleaved-1f1b", 4, 8, 2)
    assert allocate_slots(interleaved).stash_slots == max(interleaved.peak_in_flight)


def test_a_corrupted_plan_is_caught_by_the_replay() -> None:
    good = allocate_slots(build("1f1b", 2, 4))
    # Point the second stage's first forward at the wrong received-activation slot.
    t = next(t for t in range(good.ticks) if good.op[t][1] == FORWARD)
    wrong = tuple(
        tuple((slot + 1) % max(good.activation_slots, 2) if (i, s) == (t, 1) else slot for s, slot in enumerate(row))
        for i, row in enumerate(good.activation_slot)
    )
    bad = ExecutionPlan(**{**{f: getattr(good, f) for f in good.__slots__}, "activation_slot": wrong})  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        replay(bad, (0, 1))


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in V_KINDS])
def test_ring_placements_use_only_the_ring_tables(kind: str) -> None:
    """Activations to the next stage, gradients to the previous one: the tables an executor
    without V support reads say everything, on one stage, two, and more."""
    for stages in (1, 2, 3):
        schedule = build(kind, stages, 2 * stages, 2 if kind == "interleaved-1f1b" else None)
        assert allocate_slots(schedule).ring_only


@pytest.mark.parametrize("kind", V_KINDS)
def test_a_v_turns_on_the_last_stage_and_climbs_back(kind: str) -> None:
    """On P >= 3 stages: activations go down to the last stage, stay there for the turn, then
    come back up from the next stage; gradients the other way round."""
    plan = allocate_slots(build(kind, 3, 6))
    others = plan.other_directions
    assert not plan.ring_only

    def stages_with(table: tuple[tuple[int, ...], ...]) -> set[int]:
        return {s for row in table for s, slot in enumerate(row) if slot >= 0}

    assert stages_with(plan.receive_activation) == {1, 2}  # chunks 1 and 2, from stages 0 and 1
    assert stages_with(others.keep_activation) == {2}  # chunk 3, made by chunk 2 on stage 2
    assert stages_with(others.activation_from_next) == {0, 1}  # chunks 4 and 5, coming back up
    assert stages_with(plan.receive_gradient) == {0, 1}
    assert stages_with(others.keep_gradient) == {2}
    assert stages_with(others.gradient_from_previous) == {1, 2}


def tables_of(plan: ExecutionPlan) -> dict[str, list[list[int]]]:
    """The plan's tables as a generated module holds them: the other directions only where
    something arrives that way."""
    names = TABLE_ENTRIES + (() if plan.ring_only else OTHER_DIRECTIONS)
    others = plan.other_directions
    return {name: [list(row) for row in getattr(others if name in OTHER_DIRECTIONS else plan, name)] for name in names}


def read_back(schedule: Schedule) -> dict[str, list[list[int]]]:
    """The tables a generated module derives from the timelines it states for `schedule`."""
    return schedule_tables(*(" ".join(pieces) for pieces in timelines(schedule)))


@pytest.mark.parametrize(("kind", "stages", "microbatches", "virtual"), CASES)
def test_the_timelines_a_module_states_give_back_the_tables_of_the_schedule(
    kind: str, stages: int, microbatches: int, virtual: int
) -> None:
    try:
        schedule = build(kind, stages, microbatches, virtual)
    except ScheduleError:
        return
    tables = read_back(schedule)
    assert tables == tables_of(allocate_slots(schedule))
    # What runs when, against the schedule's own actions (not through the kernel's reading).
    codes = {"F": FORWARD, "B": BACKWARD, "I": INPUT_GRAD, "W": WEIGHT_GRAD}
    own = {name: [[0] * stages for _ in range(schedule.ticks)] for name in ("op", "microbatch", "chunk")}
    for stage, row in enumerate(schedule.actions_by_stage):
        for a in row:
            own["op"][a.tick][stage] = codes[a.op.value]
            own["microbatch"][a.tick][stage], own["chunk"][a.tick][stage] = a.microbatch, a.chunk
    assert {name: tables[name] for name in own} == own


def test_a_table_with_idle_ticks_of_its_own_reads_back_tick_for_tick() -> None:
    """A table from a file may start an action later than it could: its timeline says so."""
    data = to_json(build("1f1b", 3, 4))
    for action in data["actions"][0][-3:]:  # type: ignore[index]
        action["tick"] += 5
    data["ticks"] = 1 + max(a["tick"] for row in data["actions"] for a in row)  # type: ignore[attr-defined]
    schedule = table_from_json(data)
    assert any(".x" in piece for piece in timelines(schedule)[0])
    assert read_back(schedule) == tables_of(allocate_slots(schedule))


def test_a_long_steady_state_is_written_in_a_few_pieces() -> None:
    """GPT-3's 1F1B on 16 stages and 192 microbatches: warm-up, steady state and cool-down,
    with the idle ticks between them, whatever the number of microbatches."""
    schedule = build("1f1b", 16, 192)
    written = timelines(schedule)
    assert [len(pieces) for pieces in written] == [len(pieces) for pieces in timelines(build("1f1b", 16, 48))]
    assert max(len(pieces) for pieces in written) <= 10
    assert written[0] == ("F0..F15", ".x15", "(B0 F16)..(B175 F191)", "(B176 .)..(B190 .)", "B191")
    assert read_back(schedule) == tables_of(allocate_slots(schedule))
