"""The pipeline executor's tables, made from each stage's timeline.

A schedule is, for each stage, what it does tick after tick: `dslc schedule` draws it as a
timeline, one row per stage. Written down (`read_timeline`), `F3` is the forward of microbatch
3 (`B3` its backward, `I3` and `W3` the backward's halves: the gradient of the input and of
the weights), `F3c5` names chunk 5 where a stage does not simply hold the chunk of its own
number, and `.` is an idle tick; `F0..F7` is F0, F1, ..., F7, `(F4 B0)..(F7 B3)` repeats a
group one microbatch on each time, and `.x5` is five idle ticks.

The executor runs the stages in lockstep and keeps three kinds of values between ticks, each
in a slot of a buffer (`slot_tables`): the input of each chunk a stage has run forward, until
the chunk's backward is done with it (the stash); activations received for a chunk, until its
forward reads them; gradients received for a chunk, until its backward (B, or I and then W)
is done with them. Slots are handed out greedily by start tick, so a stage needs as many as
values it holds at once: the schedule's own peak, not the number of microbatches (1F1B holds
at most P microbatches where GPipe holds M). Every stage gets buffers of the largest stage's
size: the executor is one program.

Imports only the standard library: dslc allocates the slots of the tables it builds and
reads with it, and the code generator copies it into every pipelined module, which makes its
tables at import from the timelines it states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4
OP_CODES = {"F": FORWARD, "B": BACKWARD, "I": INPUT_GRAD, "W": WEIGHT_GRAD}

# The executor's tables, each [tick][stage]:
TABLE_ENTRIES = (
    "op",  # what to do: IDLE, FORWARD, BACKWARD, INPUT_GRAD or WEIGHT_GRAD
    "microbatch",  # on which microbatch
    "chunk",  # of which chunk
    "stash_slot",  # F writes the chunk's input here; B / I / W read it
    "activation_slot",  # F reads the activation it received here (every chunk but the first)
    "gradient_slot",  # B / I / W read the output gradient they received here (all but the last)
    "receive_activation",  # after the tick, store the activation arriving from stage - 1 here
    "receive_gradient",  # and the gradient arriving from stage + 1 here (-1: nothing arrives)
)
# Arrivals that only a placement other than a ring has (a V): from the other neighbour, or
# made by the stage for its own next (or previous) chunk.
OTHER_DIRECTIONS = ("activation_from_next", "gradient_from_previous", "keep_activation", "keep_gradient")
# Where a value is stored, by what it is and which way it went.
RECEIVED_IN = {
    ("activation", "next"): "receive_activation",
    ("input gradient", "previous"): "receive_gradient",
    ("activation", "previous"): "activation_from_next",
    ("input gradient", "next"): "gradient_from_previous",
    ("activation", "same"): "keep_activation",
    ("input gradient", "same"): "keep_gradient",
}


# One tick of a stage's timeline: (op, microbatch, chunk), or None when the stage is idle.
Tick = tuple[str, int, int] | None


def direction(result: str, source: int, target: int, stages: int) -> str | None:
    """How `result` goes from stage `source` to `target` round the ring of stages: "next",
    "previous" or "same"; None when they are not neighbours. Where a stage is both (on one
    or two stages), an activation goes to the next and a gradient to the previous one."""
    reaches = {"next": (source + 1) % stages, "previous": (source - 1) % stages, "same": source}
    order = ("next", "previous", "same") if result == "activation" else ("previous", "next", "same")
    return next((way for way in order if reaches[way] == target), None)


def slot_tables(timelines: Sequence[Sequence[Tick]]) -> dict[str, list[list[int]]]:
    """The executor's tables, `TABLE_ENTRIES` and `OTHER_DIRECTIONS`, [tick][stage], for a
    valid schedule given as each stage's timeline."""
    when = {tick: t for timeline in timelines for t, tick in enumerate(timeline) if tick is not None}
    holder = {tick[2]: stage for stage, timeline in enumerate(timelines) for tick in timeline if tick is not None}
    P, C, T = len(timelines), len(holder), max(map(len, timelines))

    def first(*ticks: Tick) -> int:
        return next((when[tick] for tick in ticks if tick in when), -1)

    # When each buffer holds a value for (c, m), per stage: [first tick, last tick].
    live: dict[str, list[dict[tuple[int, int], tuple[int, int]]]] = {
        buffer: [{} for _ in range(P)] for buffer in ("stash_slot", "activation_slot", "gradient_slot")
    }
    for (op, m, c), t in when.items():
        done = first(("W", m, c), ("B", m, c))  # the backward's last tick
        if op == "F":
            live["stash_slot"][holder[c]][c, m] = (t, done)
            if c > 0:
                live["activation_slot"][holder[c]][c, m] = (when["F", m, c - 1], t)
        elif op != "W" and c < C - 1:
            live["gradient_slot"][holder[c]][c, m] = (first(("I", m, c + 1), ("B", m, c + 1)), done)
    slots = {buffer: _allocate(intervals) for buffer, intervals in live.items()}

    tables = {name: [[-1] * P for _ in range(T)] for name in (*TABLE_ENTRIES, *OTHER_DIRECTIONS)}
    for name in ("op", "microbatch", "chunk"):
        tables[name] = [[0] * P for _ in range(T)]
    for (op, m, c), t in when.items():
        s = holder[c]
        tables["op"][t][s], tables["microbatch"][t][s], tables["chunk"][t][s] = OP_CODES[op], m, c
        tables["stash_slot"][t][s] = slots["stash_slot"][s][c, m]
        read = "activation_slot" if op == "F" else "gradient_slot"
        tables[read][t][s] = slots[read][s].get((c, m), -1)
        # What the tick makes arrives at the stage of the chunk that reads it (into that
        # buffer), at the end of the tick.
        if op == "F" and c < C - 1:
            result, reader = "activation", c + 1
        elif op in ("B", "I") and c > 0:
            result, reader = "input gradient", c - 1
        else:
            continue
        way = direction(result, s, holder[reader], P)
        assert way is not None, "a valid schedule puts consecutive chunks on neighbouring stages"
        tables[RECEIVED_IN[result, way]][t][holder[reader]] = slots[read][holder[reader]][reader, m]
    return tables


def _allocate(per_stage: list[dict[tuple[int, int], tuple[int, int]]]) -> list[dict[tuple[int, int], int]]:
    """Greedy interval colouring per stage: a slot is reused once its last value is dead."""
    slots = []
    for intervals in per_stage:
        free_after: list[int] = []  # slot -> the last tick it is busy
        chosen = {}
        for key, (start, end) in sorted(intervals.items(), key=lambda kv: (kv[1][0], kv[0])):
            slot = next((i for i, busy in enumerate(free_after) if busy < start), len(free_after))
            free_after[slot : slot + 1] = [end]  # a slot used again, or a new one at the end
            chosen[key] = slot
        slots.append(chosen)
    return slots


def read_timeline(text: str, stage: int) -> list[Tick]:
    """Stage `stage`'s timeline from its notation (`F0..F3 .x3 (B0 F4)..(B3 F7) B4..B7`; see
    the module's docstring): a chunk not named is the stage's own."""

    def ticks(words: str) -> list[Tick]:
        found = [(word, re.fullmatch(r"([FBIW])(\d+)(?:c(\d+))?", word)) for word in words.strip("()").split()]
        assert all(action or word == "." for word, action in found), f"not a timeline: {text!r}"
        return [(action[1], int(action[2]), int(action[3] or stage)) if action else None for _, action in found]

    timeline: list[Tick] = []
    for piece in re.findall(r"\([^()]*\)\.\.\([^()]*\)|\S+", text):
        if piece.startswith(".x") or piece == ".":
            timeline += [None] * int(piece[2:] or 1)
            continue
        first, _, last = piece.partition("..")
        group, end = ticks(first), ticks(last or first)
        # Each repetition of the group is one microbatch on, up to the last one written.
        start, stop = (next(tick[1] for tick in run if tick is not None) for run in (group, end))
        for k in range(1 + stop - start):
            timeline += [None if tick is None else (tick[0], tick[1] + k, tick[2]) for tick in group]
        assert timeline[-len(end) :] == end, f"not a timeline: {text!r}"
    return timeline


def schedule_tables(*timelines: str) -> dict[str, list[list[int]]]:
    """The executor's tables for a schedule given as each stage's timeline (stage 0 first);
    without the `OTHER_DIRECTIONS` when nothing arrives those ways (a ring placement), which
    spares the executor their sends."""
    tables = slot_tables([read_timeline(text, stage) for stage, text in enumerate(timelines)])
    ring = all(cell < 0 for name in OTHER_DIRECTIONS for row in tables[name] for cell in row)
    return {name: rows for name, rows in tables.items() if name in TABLE_ENTRIES or not ring}
