"""The buffers a schedule needs, and the slot every value lives in: the executor's tables.

A stage keeps three kinds of values between ticks:

* the input of each chunk it has run forward, until that chunk's backward no longer needs it
  (its `B`, or its `W` when the backward is split) — the *stash*;
* activations received for one of its chunks, until that chunk's forward reads them;
* gradients received for one of its chunks, until that chunk's backward (`B`, or `I` and then
  `W`) is done with them.

Each value occupies a slot from the tick it is written to its last use. Slots are handed
out greedily by start tick, so a stage needs as many slots as values it holds at once: the
schedule's own peak, not the number of microbatches. That is what makes 1F1B hold at most P
microbatches of activations where GPipe holds M.

Where received values come from. In a tick a stage makes at most one value for another chunk:
a forward's output (the next chunk's input activation) or a `B`'s or `I`'s input gradient (the
previous chunk's output gradient). It goes to the stage that holds that chunk, which the
placement puts on the next stage, the previous one, or the same stage (`table.direction`; the
stages form a ring, so the last stage's next is the first). At the end of the tick the receiver
stores it in a slot of its activations or of its gradients, whichever direction it came from.
Every value has exactly one receiver, so an executor may send each tick's value both ways round
the ring and let these tables pick what is kept. Per tick and stage, -1 where nothing arrives:

  receive_activation                         the activation arriving from stage - 1
  receive_gradient                           the gradient arriving from stage + 1
  other_directions.activation_from_next      the activation arriving from stage + 1 (a V going up)
  other_directions.gradient_from_previous    the gradient arriving from stage - 1 (a V going down)
  other_directions.keep_activation           the activation this stage made for its own next chunk
                                             (a V's turn)
  other_directions.keep_gradient             the gradient this stage made for its own previous chunk

A ring placement (one chunk per stage, or interleaved) sends every activation to the next stage
and every gradient to the previous one, so only the first two are ever set there
(`ExecutionPlan.ring_only`): an executor that passes activations forward and gradients backward
round the ring reads the `Table` fields of `ExecutionPlan` and nothing else.

The executor runs in lockstep (SPMD), so every stage gets buffers of the largest stage's
size. Everything here is static: the executor only indexes these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.schedules.table import Direction, Op, Result, Schedule, direction

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
OP_CODES = {Op.FORWARD: FORWARD, Op.BACKWARD: BACKWARD, Op.INPUT_GRAD: INPUT_GRAD, Op.WEIGHT_GRAD: WEIGHT_GRAD}

Table = tuple[tuple[int, ...], ...]  # [tick][stage]

# The table that says where a value is stored, by what it is and which way it went.
_RECEIVE_TABLE = {
    (Result.ACTIVATION, Direction.NEXT): "receive_activation",
    (Result.INPUT_GRADIENT, Direction.PREVIOUS): "receive_gradient",
    (Result.ACTIVATION, Direction.PREVIOUS): "activation_from_next",
    (Result.INPUT_GRADIENT, Direction.NEXT): "gradient_from_previous",
    (Result.ACTIVATION, Direction.SAME): "keep_activation",
    (Result.INPUT_GRADIENT, Direction.SAME): "keep_gradient",
}


@dataclass(frozen=True, slots=True)
class OtherDirections:
    """Arrivals a ring placement never has: per (tick, stage), the slot to store them in, or -1."""

    activation_from_next: Table
    gradient_from_previous: Table
    keep_activation: Table
    keep_gradient: Table


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Per (tick, stage): what to do, on what, which slots to read, and where arrivals go."""

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
    other_directions: OtherDirections
    stash_slots: int
    activation_slots: int
    gradient_slots: int

    @property
    def ring_only(self) -> bool:
        """Whether every activation goes to the next stage and every gradient to the previous
        one, so that the `Table` fields say everything."""
        others = self.other_directions
        tables = (
            others.activation_from_next,
            others.gradient_from_previous,
            others.keep_activation,
            others.keep_gradient,
        )
        return all(cell < 0 for table in tables for row in table for cell in row)


Key = tuple[int, int]  # (chunk, microbatch)


def allocate_slots(schedule: Schedule) -> ExecutionPlan:
    """The executor's tables for `schedule`, which must pass `validate`."""
    P, C, T = schedule.stages, schedule.chunks, schedule.ticks
    placement = schedule.placement
    when: dict[tuple[Op, int, int], int] = {}
    for row in schedule.actions_by_stage:
        for a in row:
            when[(a.op, a.chunk, a.microbatch)] = a.tick

    def gradient_made(chunk: int, m: int) -> int:
        """When (chunk, m)'s input gradient is made: by its I, or by its B."""
        return when.get((Op.INPUT_GRAD, chunk, m), when.get((Op.BACKWARD, chunk, m), -1))

    def last_use(chunk: int, m: int) -> int:
        """The backward's last action on (chunk, m): its W, or its B."""
        return when.get((Op.WEIGHT_GRAD, chunk, m), when.get((Op.BACKWARD, chunk, m), -1))

    # Live intervals [first tick, last tick] per stage and buffer kind, keyed by (chunk, m).
    stash: list[dict[Key, tuple[int, int]]] = [{} for _ in range(P)]
    acts: list[dict[Key, tuple[int, int]]] = [{} for _ in range(P)]
    grads: list[dict[Key, tuple[int, int]]] = [{} for _ in range(P)]
    for (op, c, m), t in when.items():
        s = placement[c]
        if op is Op.FORWARD:
            stash[s][(c, m)] = (t, last_use(c, m))
            if c > 0:
                acts[s][(c, m)] = (when[(Op.FORWARD, c - 1, m)], t)
        elif op is not Op.WEIGHT_GRAD and c < C - 1:
            grads[s][(c, m)] = (gradient_made(c + 1, m), last_use(c, m))

    stash_slot, n_stash = _allocate(stash)
    act_slot, n_act = _allocate(acts)
    grad_slot, n_grad = _allocate(grads)

    grid = [[(IDLE, 0, 0, -1, -1, -1) for _ in range(P)] for _ in range(T)]
    receive = {name: [[-1] * P for _ in range(T)] for name in _RECEIVE_TABLE.values()}
    for (op, c, m), t in when.items():
        s = placement[c]
        reads_act = act_slot[s].get((c, m), -1) if op is Op.FORWARD else -1
        reads_grad = grad_slot[s].get((c, m), -1) if op is not Op.FORWARD else -1
        grid[t][s] = (OP_CODES[op], m, c, stash_slot[s][(c, m)], reads_act, reads_grad)
        # What this action makes arrives where its consumer lives at the end of the same tick.
        if op is Op.FORWARD and c < C - 1:
            target = placement[c + 1]
            way = direction(Result.ACTIVATION, s, target, P)
            assert way is not None, "validate checks that consecutive chunks are neighbours"
            receive[_RECEIVE_TABLE[Result.ACTIVATION, way]][t][target] = act_slot[target][(c + 1, m)]
        if op in (Op.BACKWARD, Op.INPUT_GRAD) and c > 0:
            target = placement[c - 1]
            way = direction(Result.INPUT_GRADIENT, s, target, P)
            assert way is not None, "validate checks that consecutive chunks are neighbours"
            receive[_RECEIVE_TABLE[Result.INPUT_GRADIENT, way]][t][target] = grad_slot[target][(c - 1, m)]

    def column(i: int) -> Table:
        return tuple(tuple(cell[i] for cell in row) for row in grid)

    def frozen(name: str) -> Table:
        return tuple(tuple(row) for row in receive[name])

    return ExecutionPlan(
        ticks=T,
        stages=P,
        op=column(0),
        microbatch=column(1),
        chunk=column(2),
        stash_slot=column(3),
        activation_slot=column(4),
        gradient_slot=column(5),
        receive_activation=frozen("receive_activation"),
        receive_gradient=frozen("receive_gradient"),
        other_directions=OtherDirections(
            activation_from_next=frozen("activation_from_next"),
            gradient_from_previous=frozen("gradient_from_previous"),
            keep_activation=frozen("keep_activation"),
            keep_gradient=frozen("keep_gradient"),
        ),
        stash_slots=n_stash,
        activation_slots=n_act,
        gradient_slots=n_grad,
    )


def _allocate(per_stage: list[dict[Key, tuple[int, int]]]) -> tuple[list[dict[Key, int]], int]:
    """Greedy interval colouring per stage: a slot is reused once its last value is dead."""
    slots: list[dict[Key, int]] = []
    most = 0
    for intervals in per_stage:
        free_after: list[int] = []  # slot -> last tick it is busy
        chosen: dict[Key, int] = {}
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
