"""Pipeline schedules as data.

A schedule is a pure function of (stages P, microbatches M, virtual chunks per stage V) that
returns a table: for each stage and each tick, one action (F, B, I or W on one chunk and
microbatch) or idle, and which stage holds each chunk. `build` makes one and checks it with
`validate`; `render` draws it.

Units of time. The table is in unit ticks: every op, whatever it is, takes one tick. Its
`bubble_fraction` is idle slots over all stage × tick slots, the same measure for every kind.
Under it, gpipe and 1f1b give exactly (P-1)/(M+P-1), interleaved-1f1b gives (P-1)/(VM+P-1),
zb-h1 gives (P-1)/(3M+P-1) when M >= P, and zb-v gives (P-1)/(6M+P-1), the least any table
with two chunks per stage can have, for M = P and from M >= 3P/2 on. A zb-h1 microbatch is three
ticks (F, I, W) against 1f1b's two (F, B), so `retime` also measures every kind with a whole
backward costing two units and each half one, the same work for every kind; the tables `build`
makes give the same fractions there (checked for P <= 8, M <= 4P).
"""

from __future__ import annotations

import difflib
from typing import Final, Literal, assert_never

from dslc.schedules.cost import Costs, Timing, retime
from dslc.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from dslc.schedules.render import to_json, to_svg, to_text
from dslc.schedules.table import MAX_ACTIONS, Action, Op, Schedule, ring_placement, v_placement
from dslc.schedules.v_shape import v_half, zb_v
from dslc.schedules.validate import validate

__all__ = [
    "KINDS",
    "MAX_ACTIONS",
    "SPLIT_BACKWARD",
    "V_KINDS",
    "Action",
    "Costs",
    "Kind",
    "Op",
    "Schedule",
    "ScheduleError",
    "Timing",
    "build",
    "check_arguments",
    "default_virtual",
    "placement",
    "retime",
    "table_actions",
    "theoretical_bubble",
    "to_json",
    "to_svg",
    "to_text",
    "validate",
]

Kind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half"]
KINDS: Final[tuple[Kind, ...]] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half")
# The kinds that place two chunks per stage in a V (stage d holds chunks d and 2P-1-d).
V_KINDS: Final[tuple[Kind, ...]] = ("zb-v", "v-half")
# The kinds whose tables split each backward into I and W.
SPLIT_BACKWARD: Final = frozenset({"zb-h1", "zb-v", "v-half"})


class ScheduleError(ValueError):
    """A schedule that cannot be built from these arguments; the message says what to change."""


def build(kind: str, stages: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The `kind` schedule for `stages` stages, `microbatches` microbatches and `virtual` chunks
    per stage (by default the kind's own: 1, or 2 for a V), in unit ticks.

    Raises `ScheduleError` for an unknown kind, arguments the kind cannot take, or a table of
    more than `MAX_ACTIONS` actions.
    """
    checked, virtual = check_arguments(kind, stages, microbatches, virtual)
    actions = table_actions(checked, stages, microbatches, virtual)
    if actions > MAX_ACTIONS:
        chunks = f", {virtual} chunks per stage" if virtual > 1 else ""
        raise ScheduleError(
            f"the {checked} table for {stages} stages, {microbatches} microbatches{chunks} has {actions:,} "
            f"actions, more than the {MAX_ACTIONS:,} dslc builds"
        )
    match checked:
        case "gpipe":
            schedule = gpipe(stages, microbatches)
        case "1f1b":
            schedule = one_f_one_b(stages, microbatches)
        case "interleaved-1f1b":
            schedule = interleaved_1f1b(stages, microbatches, virtual)
        case "zb-h1":
            schedule = zb_h1(stages, microbatches)
        case "zb-v":
            schedule = zb_v(stages, microbatches)
        case "v-half":
            schedule = v_half(stages, microbatches)
        case _:
            assert_never(checked)
    problems = validate(schedule)
    assert not problems, f"the {checked} generator made an invalid table: {problems}"
    return schedule


def theoretical_bubble(kind: str, stages: int, microbatches: int, virtual: int | None = None) -> float | None:
    """The published closed-form bubble fraction, as idle time over stages × makespan; None
    for a kind without one.

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
    - zb-v: (P-1)/(6M+P-1) (Qi et al., 2023: zero bubble in the steady state), the least any
      table with two chunks per stage has in unit ticks (a stage's 6M ops, after the P-1 ticks
      before the last stage can start). The table matches it when M = P and when M >= 3P/2.
    - v-half: none. Qi et al., 2024 give about P/(2M) of the ideal time; its memory limit makes
      the steady state uneven, and the table lies between zb-h1's and 1f1b's when M >= P.

    Raises `ScheduleError` for the same arguments `build` rejects.
    """
    checked, virtual = check_arguments(kind, stages, microbatches, virtual)
    idle = stages - 1
    match checked:
        case "gpipe" | "1f1b":
            return idle / (microbatches + idle)
        case "interleaved-1f1b":
            return idle / (virtual * microbatches + idle)
        case "zb-h1":
            return idle / (3 * microbatches + idle)
        case "zb-v":
            return idle / (6 * microbatches + idle)
        case "v-half":
            return None
        case _:
            assert_never(checked)


def default_virtual(kind: Kind) -> int:
    """Chunks per stage when none is given: 2 on a V, else 1 (interleaving needs it given)."""
    return 2 if kind in V_KINDS else 1


def table_actions(kind: Kind, stages: int, microbatches: int, virtual: int) -> int:
    """How many actions the table has: every chunk runs F and B, or F, I and W, per microbatch."""
    ops = 2 if kind in ("gpipe", "1f1b", "interleaved-1f1b") else 3
    return stages * virtual * microbatches * ops


def placement(kind: str, stages: int, virtual: int | None = None) -> tuple[int, ...]:
    """The stage that holds each chunk in `kind`'s tables, without building one;
    `ScheduleError` where the kind cannot have `virtual` chunks per stage."""
    # Placement depends on the chunks per stage alone; P microbatches suit every kind.
    checked, virtual = check_arguments(kind, stages, stages, virtual)
    if checked in V_KINDS:
        return v_placement(stages)
    return ring_placement(stages, virtual)


def check_arguments(kind: str, stages: int, microbatches: int, virtual: int | None) -> tuple[Kind, int]:
    """The kind and its chunks per stage, if `build` can make this table whatever its size;
    otherwise `ScheduleError` saying what to change."""
    checked = _parse_kind(kind)
    if virtual is None:
        virtual = default_virtual(checked)
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
    elif checked in V_KINDS:
        if virtual != 2:
            raise ScheduleError(
                f"{checked} places two model chunks per stage in a V, got virtual={virtual};"
                " leave virtual out, or give 2"
            )
    elif virtual != 1:
        raise ScheduleError(
            f"{checked} places one model chunk per stage, got virtual={virtual}; for {virtual}"
            " chunks per stage use 'interleaved-1f1b'"
        )
    return checked, virtual


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
