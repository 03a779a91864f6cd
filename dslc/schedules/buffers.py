"""The buffers a schedule needs, and the slot every value lives in: the executor's tables.

A stage keeps three kinds of values between ticks:

* the input of each chunk it has run forward, until that chunk's backward no longer needs it
  (its `B`, or its `W` when the backward is split) — the *stash*;
* activations received from the previous stage, until its forward reads them;
* gradients received from the next stage, until its backward (`B`, or `I` and then `W`) is
  done with them.

Each value occupies a slot from the tick it is written to its last use. Slots are handed
out greedily by start tick, so a stage needs as many slots as values it holds at once: the
schedule's own peak, not the number of microbatches. That is what makes 1F1B hold at most P
microbatches of activations where GPipe holds M.

The executor runs in lockstep (SPMD), so every stage gets buffers of the largest stage's
size. Everything here is static: the executor only indexes these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.schedules.table import Op, Schedule

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
OP_CODES = {Op.FORWARD: FORWARD, Op.BACKWARD: BACKWARD, Op.INPUT_GRAD: INPUT_GRAD, Op.WEIGHT_GRAD: WEIGHT_GRAD}

Table = tuple[tuple[int, ...], ...]  # [tick][stage]


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Per (tick, stage): what to do, on what, and which slots to read and write."""

    ticks: int
    stages: int
    op: Table
    microbatch: Table
    chunk: Table
    stash_slot: Table  # F writes the chunk input here; B / I / W read it
    activation_slot: Table  # F reads its received input here (not chunk 0)
    gradient_slot: Table  # B / I / W read the received output gradient here (not the last chunk)
    receive_activation: Table  # at the end of the tick, store the activation arriving from stage - 1 here
    receive_gradient: Table  # at the end of the tick, store the gradient arriving from stage + 1 here
    stash_slots: int
    activation_slots: int
    gradient_slots: int


def plan(schedule: Schedule) -> ExecutionPlan:
    P, C, T = schedule.stages, schedule.chunks, schedule.ticks
    when: dict[tuple[Op, int, int], int] = {}
    for row in schedule.actions_by_stage:
        for a in row:
            when[(a.op, a.chunk, a.microbatch)] = a.tick
    split = any(op is Op.INPUT_GRAD for op, _, _ in when)
    grad_op = Op.INPUT_GRAD if split else Op.BACKWARD

    def last_use(chunk: int, m: int) -> int:
        return when[(Op.WEIGHT_GRAD, chunk, m)] if split else when[(Op.BACKWARD, chunk, m)]

    # Live intervals [first tick, last tick] per stage and buffer kind, keyed by (chunk, m).
    stash: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(P)]
    acts: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(P)]
    grads: list[dict[tuple[int, int], tuple[int, int]]] = [{} for _ in range(P)]
    for (op, c, m), t in when.items():
        s = c % P
        if op is Op.FORWARD:
            stash[s][(c, m)] = (t, last_use(c, m))
            if c > 0:
                acts[s][(c, m)] = (when[(Op.FORWARD, c - 1, m)], t)
        elif op is grad_op and c < C - 1:
            grads[s][(c, m)] = (when[(grad_op, c + 1, m)], last_use(c, m))

    stash_slot, n_stash = _allocate(stash)
    act_slot, n_act = _allocate(acts)
    grad_slot, n_grad = _allocate(grads)

    grid = [[(IDLE, 0, 0, -1, -1, -1) for _ in range(P)] for _ in range(T)]
    receive_act = [[-1] * P for _ in range(T)]
    receive_grad = [[-1] * P for _ in range(T)]
    for (op, c, m), t in when.items():
        s = c % P
        reads_act = act_slot[s].get((c, m), -1) if op is Op.FORWARD else -1
        reads_grad = grad_slot[s].get((c, m), -1) if op is not Op.FORWARD else -1
        grid[t][s] = (OP_CODES[op], m, c, stash_slot[s][(c, m)], reads_act, reads_grad)
        # What this action sends arrives at its neighbour at the end of the same tick.
        if op is Op.FORWARD and c < C - 1:
            receive_act[t][(c + 1) % P] = act_slot[(c + 1) % P][(c + 1, m)]
        if op is grad_op and c > 0:
            receive_grad[t][(c - 1) % P] = grad_slot[(c - 1) % P][(c - 1, m)]

    def column(i: int) -> Table:
        return tuple(tuple(cell[i] for cell in row) for row in grid)

    return ExecutionPlan(
        ticks=T,
        stages=P,
        op=column(0),
        microbatch=column(1),
        chunk=column(2),
        stash_slot=column(3),
        activation_slot=column(4),
        gradient_slot=column(5),
        receive_activation=tuple(tuple(r) for r in receive_act),
        receive_gradient=tuple(tuple(r) for r in receive_grad),
        stash_slots=n_stash,
        activation_slots=n_act,
        gradient_slots=n_grad,
    )


def _allocate(per_stage: list[dict[tuple[int, int], tuple[int, int]]]) -> tuple[list[dict[tuple[int, int], int]], int]:
    """Greedy interval colouring per stage: a slot is reused once its last value is dead."""
    slots: list[dict[tuple[int, int], int]] = []
    most = 0
    for intervals in per_stage:
        free_after: list[int] = []  # slot -> last tick it is busy
        chosen: dict[tuple[int, int], int] = {}
        for key, (start, end) in sorted(intervals.items(), key=lambda kv: (kv[1][0], kv[0])):
            slot = next((i for i, busy in enumerate(free_after) if busy < start), len(free_after))
            if slot == len(free_after):
                free_after.append(end)
            else:
                free_after[slot] = end
            chosen[key] = slot
        slots.append(chosen)
        most = max(most, len(free_after))
    return slots, most
