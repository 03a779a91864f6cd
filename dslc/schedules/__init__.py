"""Pipeline schedules as data.

A schedule is a pure function of (stages P, microbatches M, virtual chunks per stage V) that
returns a table: for each stage and each tick, one action (F, B, I or W on one chunk and
microbatch) or idle. `build` makes one and checks it with `validate`; `render` draws it.

Units of time. The table is in unit ticks: every op, whatever it is, takes one tick. Its
`bubble_fraction` is idle slots over all stage × tick slots, the same measure for every kind.
Under it, gpipe and 1f1b give exactly (P-1)/(M+P-1), interleaved-1f1b gives (P-1)/(VM+P-1),
and zb-h1 gives (P-1)/(3M+P-1) when M >= P. A zb-h1 microbatch is three ticks (F, I, W)
against 1f1b's two (F, B), so `retime` also measures every kind with a whole backward costing
two units and each half one, the same work for every kind; the tables `build` makes give the
same fractions there (checked for P <= 8, M <= 4P).
"""

from __future__ import annotations

import difflib
from typing import Final, Literal, assert_never

from dslc.schedules.cost import Costs, Timing, retime
from dslc.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from dslc.schedules.render import to_json, to_svg, to_text
from dslc.schedules.table import Action, Op, Schedule
from dslc.schedules.validate import validate

__all__ = [
    "KINDS",
    "SPLIT_BACKWARD",
    "Action",
    "Costs",
    "Kind",
    "Op",
    "Schedule",
    "ScheduleError",
    "Timing",
    "build",
    "retime",
    "theoretical_bubble",
    "to_json",
    "to_svg",
    "to_text",
    "validate",
]

Kind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
KINDS: Final[tuple[Kind, ...]] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
# The kinds whose tables split each backward into I and W.
SPLIT_BACKWARD: Final = frozenset({"zb-h1"})


class ScheduleError(ValueError):
    """A schedule that cannot be built from these arguments; the message says what to change."""


def build(kind: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The `kind` schedule for `stages` stages, `microbatches` microbatches and `virtual` chunks
    per stage, in unit ticks.

    Raises `ScheduleError` for an unknown kind or arguments the kind cannot take.
    """
    checked = _check_arguments(kind, stages, microbatches, virtual)
    match checked:
        case "gpipe":
            schedule = gpipe(stages, microbatches)
        case "1f1b":
            schedule = one_f_one_b(stages, microbatches)
        case "interleaved-1f1b":
            schedule = interleaved_1f1b(stages, microbatches, virtual)
        case "zb-h1":
            schedule = zb_h1(stages, microbatches)
        case _:
            assert_never(checked)
    problems = validate(schedule)
    assert not problems, f"the {checked} generator made an invalid table: {problems}"
    return schedule


def theoretical_bubble(kind: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The published closed-form bubble fraction, as idle time over stages × makespan.

    The papers state the bubble against the ideal (bubble-free) time; over the whole makespan,
    the measure `Schedule.bubble_fraction` uses, the same figures read:

    - gpipe, 1f1b: (P-1)/(M+P-1) (Huang et al., 2019; Narayanan et al., 2021: (P-1)/M of the
      ideal time). It holds for any ratio of backward to forward cost, unit ticks included;
      the table matches it exactly.
    - interleaved-1f1b: (P-1)/(VM+P-1) (Narayanan et al., 2021: (P-1)/(VM)), where each chunk's
      op costs 1/V of a whole stage's. In unit ticks the table matches it exactly.
    - zb-h1: (P-1)/(3M+P-1) (Qi et al., 2023: P-1 units idle per stage) with F, I and W costing
      one unit each, which is the table's unit tick. The table matches it when M >= P; with
      fewer microbatches the pipeline never reaches its steady state, the table takes longer
      than 3M+P-1 ticks and its bubble is larger than this figure.

    Raises `ScheduleError` for the same arguments `build` rejects.
    """
    checked = _check_arguments(kind, stages, microbatches, virtual)
    idle = stages - 1
    match checked:
        case "gpipe" | "1f1b":
            return idle / (microbatches + idle)
        case "interleaved-1f1b":
            return idle / (virtual * microbatches + idle)
        case "zb-h1":
            return idle / (3 * microbatches + idle)
        case _:
            assert_never(checked)


def _check_arguments(kind: str, stages: int, microbatches: int, virtual: int) -> Kind:
    checked = _parse_kind(kind)
    problems = [
        problem
        for name, value in (
            ("stages", stages),
            ("microbatches", microbatches),
            ("virtual", virtual),
        )
        if (problem := _count_problem(name, value))
    ]
    if problems:
        raise ScheduleError("; ".join(problems))
    if checked == "interleaved-1f1b":
        if virtual < 2:
            raise ScheduleError(
                f"interleaved-1f1b needs at least 2 model chunks per stage, got virtual={virtual};"
                " with one chunk per stage use '1f1b'"
            )
        if microbatches % stages:
            below = microbatches - microbatches % stages
            options = f"{below} or {below + stages}" if below else f"{stages}"
            raise ScheduleError(
                f"interleaved-1f1b sends microbatches in groups of stages={stages}, so microbatches"
                f" must be a multiple of {stages}, got {microbatches}; try {options}"
            )
    elif virtual != 1:
        raise ScheduleError(
            f"{checked} places one model chunk per stage, got virtual={virtual}; for {virtual}"
            " chunks per stage use 'interleaved-1f1b'"
        )
    return checked


def _parse_kind(kind: str) -> Kind:
    for known in KINDS:
        if kind == known:
            return known
    close = difflib.get_close_matches(str(kind).lower(), KINDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ScheduleError(f"unknown pipeline schedule {kind!r}, expected one of {', '.join(KINDS)}{hint}")


def _count_problem(name: str, value: int) -> str | None:
    # bool is an int subclass, but `stages=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be a whole number, got {value!r}"
    if value < 1:
        return f"{name} must be at least 1, got {value}"
    return None
