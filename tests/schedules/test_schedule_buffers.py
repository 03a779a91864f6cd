"""The executor's buffer plan: every value is where the plan says when it is read, and no
slot is reused while its value is still needed."""

from __future__ import annotations

import pytest

from dslc.schedules import KINDS, ScheduleError, build
from dslc.schedules.buffers import BACKWARD, FORWARD, IDLE, INPUT_GRAD, WEIGHT_GRAD, ExecutionPlan, plan


def replay(p: ExecutionPlan, chunks: int) -> None:
    """Run the plan on labels instead of tensors and check every read finds the right one."""
    stages = p.stages
    stash = [dict[int, tuple[int, int]]() for _ in range(stages)]
    acts = [dict[int, tuple[int, int]]() for _ in range(stages)]
    grads = [dict[int, tuple[int, int]]() for _ in range(stages)]
    done_w: set[tuple[int, int]] = set()
    for t in range(p.ticks):
        sent_act: list[tuple[int, int] | None] = [None] * stages
        sent_grad: list[tuple[int, int] | None] = [None] * stages
        for s in range(stages):
            op, m, c = p.op[t][s], p.microbatch[t][s], p.chunk[t][s]
            if op == IDLE:
                continue
            assert c % stages == s
            if op == FORWARD:
                if c > 0:
                    assert acts[s].get(p.activation_slot[t][s]) == (c, m), (t, s, c, m)
                stash[s][p.stash_slot[t][s]] = (c, m)
                sent_act[s] = (c + 1, m) if c < chunks - 1 else None
            else:
                assert stash[s].get(p.stash_slot[t][s]) == (c, m), (t, s, op, c, m)
                if c < chunks - 1:
                    assert grads[s].get(p.gradient_slot[t][s]) == (c, m), (t, s, op, c, m)
                if op in (BACKWARD, INPUT_GRAD):
                    sent_grad[s] = (c - 1, m) if c > 0 else None
                if op == WEIGHT_GRAD:
                    done_w.add((c, m))
        for s in range(stages):
            got = sent_act[(s - 1) % stages]
            if p.receive_activation[t][s] >= 0:
                assert got is not None and got[0] % stages == s
                acts[s][p.receive_activation[t][s]] = got
            else:
                assert got is None
            got = sent_grad[(s + 1) % stages]
            if p.receive_gradient[t][s] >= 0:
                assert got is not None and got[0] % stages == s
                grads[s][p.receive_gradient[t][s]] = got
            else:
                assert got is None


CASES = [(k, P, M, V) for k in KINDS for P in (1, 2, 3, 4) for M in (1, 2, 4, 8) for V in (1, 2)]


@pytest.mark.parametrize(("kind", "stages", "microbatches", "virtual"), CASES)
def test_replaying_the_plan_finds_every_value_in_its_slot(
    kind: str, stages: int, microbatches: int, virtual: int
) -> None:
    try:
        schedule = build(kind, stages, microbatches, virtual)
    except ScheduleError:
        return
    replay(plan(schedule), schedule.chunks)


def test_stash_is_sized_by_the_schedule_not_by_the_microbatches() -> None:
    for m in (4, 8, 16):
        assert plan(build("gpipe", 2, m)).stash_slots == m
        assert plan(build("1f1b", 2, m)).stash_slots == 2
        assert plan(build("zb-h1", 2, m)).stash_slots == 2
    assert plan(build("1f1b", 4, 8)).stash_slots == max(build("1f1b", 4, 8).peak_in_flight) == 4
    interleaved = build("interleaved-1f1b", 4, 8, 2)
    assert plan(interleaved).stash_slots == max(interleaved.peak_in_flight)


def test_a_corrupted_plan_is_caught_by_the_replay() -> None:
    good = plan(build("1f1b", 2, 4))
    # Point the second stage's first forward at the wrong received-activation slot.
    t = next(t for t in range(good.ticks) if good.op[t][1] == FORWARD)
    wrong = tuple(
        tuple((slot + 1) % max(good.activation_slots, 2) if (i, s) == (t, 1) else slot for s, slot in enumerate(row))
        for i, row in enumerate(good.activation_slot)
    )
    bad = ExecutionPlan(**{**{f: getattr(good, f) for f in good.__slots__}, "activation_slot": wrong})  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        replay(bad, 2)
