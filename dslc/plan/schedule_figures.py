"""A schedule's length, bubble and buffer slots in closed form, without building its table.

Searching plans costs thousands of (kind, stages, microbatches, virtual) combinations, and
building and validating one table for 192 microbatches on 16 stages takes a tenth of a second
(a second or more for a hundred stages). The figures the planner reads from a table have
closed forms, for P >= 2 stages, M microbatches and V chunks per stage:

* ticks: a stage does 2·V·M unit ops (3·M for zb-h1's F, I and W) and waits 2(P − 1) ticks
  to fill and drain the pipeline — zb-h1 P − 1, its deferred W ops filling the drain, once
  M >= P; with fewer microbatches it never reaches that steady state and waits 2P − 1 − M;
* bubble: idle slots over all slots, 1 − ops / ticks (`theoretical_bubble` where it applies);
* buffer slots (stash, received activations, received gradients): a stage holds at most the
  microbatches in flight. GPipe stashes all M and holds up to 2 received values of each kind;
  1F1B stashes min(M, P), receives up to 2 activations and 1 gradient; zb-h1 keeps min(M, P)
  stash slots and as many gradient slots, for its deferred W ops; interleaved-1f1b stashes
  V·P chunk inputs when M = P and (V + 1)·P − 1 from M = 2P on (Megatron-LM's warm-up
  depth), receives 2 activations and P // 2 + 1 gradients.

These are what `dslc.schedules.build` and `dslc.schedules.buffers.allocate_slots` give; tests hold them
equal over a grid of sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.schedules import Kind, theoretical_bubble


@dataclass(frozen=True, slots=True)
class Figures:
    """What the planner reads from a schedule table (`Schedule`, `ExecutionPlan`)."""

    ticks: int
    bubble_fraction: float
    stash_slots: int
    activation_slots: int
    gradient_slots: int


def figures(kind: Kind, stages: int, microbatches: int, virtual: int = 1) -> Figures:
    """The figures of `build(kind, stages, microbatches, virtual)` for two or more stages;
    `ScheduleError` for the arguments `build` rejects."""
    assert stages >= 2, "one stage runs no pipeline"
    theoretical_bubble(kind, stages, microbatches, virtual)  # raises for what `build` rejects
    P, M, V = stages, microbatches, virtual
    match kind:
        case "gpipe":
            ops, ticks, slots = 2 * M, 2 * (M + P - 1), (M, min(M, 2), min(M, 2))
        case "1f1b":
            ops, ticks, slots = 2 * M, 2 * (M + P - 1), (min(M, P), min(M, 2), 1)
        case "zb-h1":
            ops, ticks, slots = 3 * M, max(3 * M + P - 1, 2 * M + 2 * P - 1), (min(M, P), min(M, 2), min(M, P))
        case "interleaved-1f1b":
            stash = V * P if M == P else (V + 1) * P - 1
            ops, ticks, slots = 2 * V * M, 2 * (V * M + P - 1), (stash, 2, P // 2 + 1)
        case _:
            assert_never(kind)
    return Figures(ticks, 1 - ops / ticks, *slots)
