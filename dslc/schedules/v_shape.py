"""Schedules on a V: two chunks per stage, stage d holding chunks d and 2P-1-d.

The model runs down the stages on the first chunks and back up on the second ones, so the
last stage turns a microbatch round by itself and stage 0 both starts it and computes its loss.
Every stage then does the same work, and a microbatch's activations on a stage live for about
the same time whichever stage it is: what 1F1B holds on its first stage, a V spreads evenly
(Qi et al., "Zero Bubble Pipeline Parallelism", 2023, for the V with split backwards; "Pipeline
Parallelism with Controllable Memory", 2024, for the family whose memory can be set).

The table is made by list scheduling in unit ticks: each tick, every stage runs the first of
these that is ready (its inputs made in an earlier tick) and fits in its memory —

1. a forward, the second chunk's before the first's (the second is nearer the loss, and its
   place may be waiting for it);
2. an input gradient (I), the first chunk's before the second's (the first chunk's input has
   been held longest);
3. a deferred weight gradient (W), which nothing waits for: it fills what would be idle;

each op taking its chunk's microbatches in order. A chunk's input is held from its forward to
its W, and a stage may hold `limit` of them. Where the limit is tight, a stage takes a new
microbatch on its first chunk only with room both for it and for its return on the second
(`hold_return`), so no stage can fill up with microbatches that cannot come back: v-half. With
zb-v's 2P places that reservation costs ticks and is not needed — no table got stuck for any P
up to 48 with M up to 4P, nor for M up to 300 on up to 16 stages — and a table that did would
stop with an internal error, never hang.

With every op costing one tick, a stage does 6M ticks of work and the last stage cannot start
before tick P-1, so no schedule with two chunks per stage finishes before 6M + P - 1 ticks: a
bubble of at least (P-1) / (6M + P - 1).
"""

from __future__ import annotations

from dslc.schedules.table import Action, Op, Schedule, v_placement

_NEVER = 1 << 62  # the tick of something not done yet


def v_shape(kind: str, stages: int, microbatches: int, limit: int, hold_return: bool) -> Schedule:
    """The V's table when a stage holds at most `limit` chunk inputs (see the module
    docstring); at least 2, so that one microbatch fits."""
    assert limit >= 2, "one microbatch must fit"
    P, M = stages, microbatches
    C = 2 * P
    # When each (chunk, microbatch)'s F and I ran; the next microbatch each op takes per chunk.
    forward_at = [[_NEVER] * M for _ in range(C)]
    input_grad_at = [[_NEVER] * M for _ in range(C)]
    next_f, next_i, next_w = [0] * C, [0] * C, [0] * C
    held = [0] * P  # chunk inputs each stage holds
    returning = [0] * P  # microbatches past a stage's first chunk, not yet back on its second
    rows: list[list[Action]] = [[] for _ in range(P)]
    remaining = 3 * C * M
    tick = 0
    while remaining:
        chosen: list[tuple[int, Op, int, int]] = []
        for stage in range(P):
            down, up = stage, C - 1 - stage
            room = limit - held[stage] - (returning[stage] if hold_return else 0)
            candidates = (
                (Op.FORWARD, up, next_f, held[stage] < limit),
                (Op.FORWARD, down, next_f, room >= (2 if hold_return else 1)),
                (Op.INPUT_GRAD, down, next_i, True),
                (Op.INPUT_GRAD, up, next_i, True),
                (Op.WEIGHT_GRAD, up, next_w, True),
                (Op.WEIGHT_GRAD, down, next_w, True),
            )
            for op, chunk, taken, fits in candidates:
                m = taken[chunk]
                if fits and _ready(op, chunk, m, tick, forward_at, input_grad_at, next_i, M):
                    chosen.append((stage, op, chunk, m))
                    break
        # Nothing run this tick means nothing new is ready next tick either.
        assert chosen, f"internal error: the {kind} table is stuck at tick {tick}"
        for stage, op, chunk, m in chosen:
            rows[stage].append(Action(tick, stage, op, m, chunk))
            remaining -= 1
            match op:
                case Op.FORWARD:
                    forward_at[chunk][m] = tick
                    next_f[chunk] += 1
                    held[stage] += 1
                    returning[stage] += 1 if chunk == stage else -1
                case Op.INPUT_GRAD:
                    input_grad_at[chunk][m] = tick
                    next_i[chunk] += 1
                case _:
                    next_w[chunk] += 1
                    held[stage] -= 1
        tick += 1
    return Schedule(kind, P, M, 2, tick, tuple(tuple(row) for row in rows), v_placement(P))


def _ready(
    op: Op,
    chunk: int,
    m: int,
    tick: int,
    forward_at: list[list[int]],
    input_grad_at: list[list[int]],
    next_i: list[int],
    microbatches: int,
) -> bool:
    """Whether `op` on (`chunk`, `m`) has its inputs, made before `tick`."""
    match op:
        case Op.FORWARD:
            return m < microbatches and (chunk == 0 or forward_at[chunk - 1][m] < tick)
        case Op.INPUT_GRAD:
            last = chunk == len(forward_at) - 1
            return m < microbatches and forward_at[chunk][m] < tick and (last or input_grad_at[chunk + 1][m] < tick)
        case _:
            return m < next_i[chunk] and input_grad_at[chunk][m] < tick


def zb_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V: a stage holds at most 2P chunk inputs, the chunk-microbatches of 1F1B's first
    stage (P microbatches of a whole stage)."""
    return v_shape("zb-v", stages, microbatches, limit=2 * stages, hold_return=False)


def v_half(stages: int, microbatches: int) -> Schedule:
    """V-Half: a stage holds at most (P + 2) // 2 microbatches of a whole stage, about half of
    1F1B's P, as 2 * ((P + 2) // 2) chunk inputs, keeping room for each one's return."""
    return v_shape("v-half", stages, microbatches, limit=2 * ((stages + 2) // 2), hold_return=True)
