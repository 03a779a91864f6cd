"""Text, JSON and SVG renderings of schedules."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dslc.schedules import KINDS, build, to_json, to_svg, to_text
from dslc.schedules.render import tick_legend

SVG = "{http://www.w3.org/2000/svg}"
GOLDENS = Path(__file__).parent / "goldens"


def examples() -> list[tuple[str, int, int, int | None]]:
    return [(kind, 3, 6, 2 if kind == "interleaved-1f1b" else None) for kind in KINDS]


def test_text_timeline_1f1b() -> None:
    assert to_text(build("1f1b", 2, 3)) == (
        "1f1b: 2 stages, 3 microbatches, 1 chunk per stage\n"
        "tick     0  1  2  3  4  5  6  7\n"
        "stage 0  F0 F1 .  B0 F2 B1 .  B2\n"
        "stage 1  .  F0 B0 F1 B1 F2 B2 .\n"
        "8 ticks, bubble fraction 0.250, peak in flight [2, 1]\n"
    )


def test_text_timeline_shows_chunks_when_stages_hold_several() -> None:
    assert to_text(build("interleaved-1f1b", 2, 2, 2)) == (
        "interleaved-1f1b: 2 stages, 2 microbatches, 2 chunks per stage\n"
        "tick             0    1    2    3    4    5    6    7    8    9\n"
        "stage 0 (c0 c2)  F0c0 F1c0 F0c2 F1c2 .    B0c2 .    B1c2 B0c0 B1c0\n"
        "stage 1 (c1 c3)  .    F0c1 F1c1 F0c3 B0c3 F1c3 B1c3 B0c1 B1c1 .\n"
        "10 ticks, bubble fraction 0.200, peak in flight [4, 3]\n"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_timelines_at_four_stages_eight_microbatches_match_goldens(kind: str, update_goldens: bool) -> None:
    """The tables themselves, pinned: a change to any generator shows up as a diff here."""
    schedule = build(kind, 4, 8, 2 if kind == "interleaved-1f1b" else None)
    name = f"{kind}-p4-m8-v{schedule.virtual}"
    outputs = {f"{name}.txt": to_text(schedule)}
    if kind in ("zb-h1", "zb-v"):
        outputs[f"{name}.svg"] = to_svg(schedule)
    for name, output in outputs.items():
        path = GOLDENS / name
        if update_goldens:
            path.write_text(output)
        assert output == path.read_text(), f"{name} changed; review, then rerun with --update-goldens"


def test_a_v_shows_each_stage_holding_two_chunks() -> None:
    text = to_text(build("zb-v", 3, 3))
    names = [line.split(")")[0] + ")" for line in text.splitlines()[2:5]]
    assert names == ["stage 0 (c0 c5)", "stage 1 (c1 c4)", "stage 2 (c2 c3)"]
    svg = ET.fromstring(to_svg(build("zb-v", 3, 3)))
    assert "stage 2 (c2 c3)" in [element.text for element in svg.iter(f"{SVG}text")]


def test_text_timeline_zb_h1_uses_split_backwards() -> None:
    text = to_text(build("zb-h1", 2, 2))
    assert "I0" in text and "W0" in text and "B0" not in text


def test_the_tick_legend_says_what_a_tick_is_with_the_schedules_own_actions() -> None:
    assert tick_legend(build("1f1b", 2, 3)) == (
        "a tick: each stage runs at most one action (F forward, B backward) on one microbatch of one chunk; "
        "the stages keep step, so a tick lasts as long as its slowest action (`dslc plan` estimates a step in "
        "seconds)"
    )
    assert "(F forward, I input gradient, W weight gradient)" in tick_legend(build("zb-h1", 2, 2))


@pytest.mark.parametrize("request_", examples())
def test_json_carries_the_whole_table(request_: tuple[str, int, int, int | None]) -> None:
    schedule = build(*request_)
    data = to_json(schedule)
    assert json.loads(json.dumps(data)) == data
    assert {k: data[k] for k in ("kind", "stages", "microbatches", "virtual", "placement", "ticks")} == {
        "kind": schedule.kind,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "virtual": schedule.virtual,
        "placement": list(schedule.placement),
        "ticks": schedule.ticks,
    }
    assert data["bubble_fraction"] == schedule.bubble_fraction
    assert data["peak_in_flight"] == list(schedule.peak_in_flight)
    assert data["actions"] == [
        [{"tick": a.tick, "op": a.op.value, "microbatch": a.microbatch, "chunk": a.chunk} for a in row]
        for row in schedule.actions_by_stage
    ]
    assert {entry["op"] for row in data["actions"] for entry in row} <= {"F", "B", "I", "W"}


@pytest.mark.parametrize("request_", examples())
def test_svg_is_well_formed_with_a_cell_per_slot(request_: tuple[str, int, int, int | None]) -> None:
    schedule = build(*request_)
    svg = to_svg(schedule)
    assert svg == to_svg(build(*request_))
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    cells = root.findall(f"{SVG}rect")
    ops = {a.op for row in schedule.actions_by_stage for a in row}
    # One rect per (stage, tick), then one legend swatch per op used and one for idle.
    assert len(cells) == schedule.stages * schedule.ticks + len(ops) + 1
    tooltips = [title.text for title in root.iter(f"{SVG}title")]
    assert "stage 0, tick 0: forward, microbatch 0, chunk 0" in tooltips


def test_svg_escapes_text() -> None:
    schedule = dataclasses.replace(build("gpipe", 2, 2), kind='<b>&"x"')
    svg = to_svg(schedule)
    assert "<b>" not in svg
    assert "&lt;b&gt;&amp;" in svg
    assert ET.fromstring(svg).findtext(f"{SVG}title", "").startswith('<b>&"x"')
