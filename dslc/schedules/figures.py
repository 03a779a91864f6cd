"""A schedule's length, bubble, activations in flight and buffer slots, read off its table or
in closed form without building it.

Searching plans costs thousands of (kind, stages, microbatches, virtual) combinations, and a
table of 64 stages by a million microbatches would never be built (`MAX_ACTIONS`). The figures
the planner reads have closed forms, for P >= 2 stages, M microbatches and V chunks per stage:

* ticks: a stage does 2·V·M unit ops (3·M for zb-h1's F, I and W, 6·M for a V's two chunks)
  and waits 2(P − 1) ticks to fill and drain the pipeline — zb-h1 P − 1, its deferred W ops
  filling the drain, once M >= P; with fewer microbatches it never reaches that steady state
  and waits 2P − 1 − M. zb-v waits P − 1 (the least any table with two chunks per stage can)
  when M = P or M >= 3P/2; between them its memory limit costs 3P − 2M more, and below P it
  waits max(4P − 1 − 4M, 3P − 1 − 2M) more;
* bubble: idle slots over all slots, (ticks − ops) / ticks;
* activations in flight (forward to B or I, the most on any stage): M for GPipe, min(M, P) for
  1F1B and zb-h1, 2·min(M, P) for zb-v, min(V·M, (V + 1)·P − 1) interleaved;
* buffer slots (stash, received activations, received gradients): a stage holds at most the
  microbatches in flight. GPipe stashes all M and holds up to 2 received values of each kind;
  1F1B stashes min(M, P), receives up to 2 activations and 1 gradient; zb-h1 keeps min(M, P)
  stash slots and as many gradient slots, for its deferred W ops; interleaved-1f1b stashes
  V·P chunk inputs when M = P and (V + 1)·P − 1 from M = 2P on (Megatron-LM's warm-up
  depth), receives 2 activations and P // 2 + 1 gradients; zb-v stashes 2·min(M, P), receives
  up to 3 activations, and up to 2M gradients below P microbatches, 2P - 1 at M = P + 1, then
  two fewer per microbatch down to 2·(P // 2) + 2 (3 on two stages).

v-half has no closed form (its memory limit makes its steady state uneven), nor does any kind
on one stage (several chunks on one device): their figures come from their tables, which limits
them to `MAX_ACTIONS`. Tests hold the closed forms equal to the tables' figures over a grid of
sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import assert_never

from dslc.schedules import Schedule, build, check_arguments
from dslc.schedules.buffers import allocate_slots


@dataclass(frozen=True, slots=True)
class Figures:
    """What the planner reads from a schedule table (`Schedule`, `ExecutionPlan`)."""

    ticks: int
    bubble_fraction: float
    peak_in_flight: int  # on the busiest stage
    stash_slots: int
    activation_slots: int
    gradient_slots: int


def table_figures(schedule: Schedule) -> Figures:
    """The figures of a table that is at hand."""
    slots = allocate_slots(schedule)
    return Figures(
        schedule.ticks,
        schedule.bubble_fraction,
        max(schedule.peak_in_flight),
        slots.stash_slots,
        slots.activation_slots,
        slots.gradient_slots,
    )


def closed_form(kind: str, stages: int) -> bool:
    """Whether `figures` can do without the table (so that its size does not matter)."""
    return stages >= 2 and kind != "v-half"


@functools.lru_cache(maxsize=64)
def figures(kind: str, stages: int, microbatches: int, virtual: int | None = None) -> Figures:
    """The figures of `build(kind, stages, microbatches, virtual)`, without building it where
    the kind has closed forms; `ScheduleError` for the arguments `build` rejects (and where
    there is no closed form, for a table too large to build)."""
    checked, V = check_arguments(kind, stages, microbatches, virtual)
    P, M = stages, microbatches
    if not closed_form(checked, P):
        return table_figures(build(checked, P, M, V))
    match checked:
        case "gpipe":
            ops, ticks, peak, slots = 2 * M, 2 * (M + P - 1), M, (M, min(M, 2), min(M, 2))
        case "1f1b":
            ops, ticks, peak, slots = 2 * M, 2 * (M + P - 1), min(M, P), (min(M, P), min(M, 2), 1)
        case "zb-h1":
            ticks = max(3 * M + P - 1, 2 * M + 2 * P - 1)
            ops, peak, slots = 3 * M, min(M, P), (min(M, P), min(M, 2), min(M, P))
        case "interleaved-1f1b":
            stash = V * P if M == P else (V + 1) * P - 1
            peak = min(V * M, (V + 1) * P - 1)
            ops, ticks, slots = 2 * V * M, 2 * (V * M + P - 1), (stash, 2, P // 2 + 1)
        case "zb-v":
            ops, ticks, peak, slots = 6 * M, _zb_v_ticks(P, M), 2 * min(M, P), _zb_v_slots(P, M)
        case "v-half":
            raise AssertionError("closed_form says v-half has none")
        case _:
            assert_never(checked)
    # One division of whole numbers, as the table computes it, so that the two are equal floats.
    return Figures(ticks, (ticks - ops) / ticks, peak, *slots)


def _zb_v_ticks(P: int, M: int) -> int:
    floor = 6 * M + P - 1
    if M < P:
        return floor + max(3 * P - 4 * M, 2 * (P - M))
    if P < M < 3 * P / 2:
        return floor + 3 * P - 2 * M
    return floor


def _zb_v_slots(P: int, M: int) -> tuple[int, int, int]:
    received = 2 if M == 1 else 3
    if M <= P:
        gradients = 2 * M
    elif M == P + 1:
        gradients = 2 * P - 1
    else:
        gradients = max(3 if P == 2 else 2 * (P // 2) + 2, 2 * (2 * P - M + 1))
    return 2 * min(M, P), received, gradients
