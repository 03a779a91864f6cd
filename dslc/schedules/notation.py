"""A schedule as each stage's timeline, written the way the generated module states it.

`dslc.runtime.schedule.read_timeline` reads it back (its module's docstring says how it
reads). Runs are written short: a group of one to `LONGEST_GROUP` ticks that repeats at least
three times, one microbatch on each time, as its first and last repetition (`F0..F15`,
`(B0 F16)..(B175 F191)`), and three or more idle ticks as `.x15`; the run that covers most
ticks first. A stage's idle ticks after its last action are left out.
"""

from __future__ import annotations

from dslc.runtime.schedule import Tick
from dslc.schedules.table import Schedule

LONGEST_GROUP = 6


def timelines(schedule: Schedule) -> tuple[tuple[str, ...], ...]:
    """Each stage's timeline (stage 0 first) as its pieces: a tick, or a run of them."""
    named = schedule.placement != tuple(range(schedule.stages))
    out = []
    for row in schedule.grid():
        ticks: list[Tick] = [None if a is None else (a.op.value, a.microbatch, a.chunk) for a in row]
        while ticks and ticks[-1] is None:
            ticks.pop()
        out.append(_pieces(ticks, named))
    return tuple(out)


def _pieces(ticks: list[Tick], named: bool) -> tuple[str, ...]:
    pieces = []
    i = 0
    while i < len(ticks):
        idle = next((n for n, tick in enumerate(ticks[i:]) if tick is not None), len(ticks) - i)
        size, times = _longest_run(ticks, i)
        if idle >= 3 and idle >= size * times:
            pieces.append(f".x{idle}")
            i += idle
            continue
        group = ticks[i : i + size]
        first = " ".join(_word(tick, named) for tick in group)
        if times == 1:
            pieces.append(first)
        else:
            last = " ".join(_word(_on(tick, times - 1), named) for tick in group)
            pieces.append(f"{first}..{last}" if size == 1 else f"({first})..({last})")
        i += size * times
    return tuple(pieces)


def _longest_run(ticks: list[Tick], start: int) -> tuple[int, int]:
    """(group size, repetitions) of the group with an action that covers most ticks from
    `start`, repeated one microbatch on each time: (1, 1) when none repeats three times."""
    best = (1, 1)
    for size in range(1, LONGEST_GROUP + 1):
        group = ticks[start : start + size]
        if len(group) < size:
            break
        if all(tick is None for tick in group):
            continue
        times = 1
        while ticks[start + times * size : start + (times + 1) * size] == [_on(tick, times) for tick in group]:
            times += 1
        if times >= 3 and size * times > best[0] * best[1]:
            best = (size, times)
    return best


def _on(tick: Tick, microbatches: int) -> Tick:
    return None if tick is None else (tick[0], tick[1] + microbatches, tick[2])


def _word(tick: Tick, named: bool) -> str:
    if tick is None:
        return "."
    op, microbatch, chunk = tick
    return f"{op}{microbatch}" + (f"c{chunk}" if named else "")
