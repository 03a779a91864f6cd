"""Show a schedule: a text timeline, JSON for tools, and a self-contained SVG.

All three read only the table and are deterministic: the same schedule gives the same bytes.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import assert_never

from dslc.schedules.table import Action, Op, Schedule

_IDLE = "."


def to_text(schedule: Schedule) -> str:
    """A timeline: one row per stage, one column per tick, then a summary line.

    Cells read `F3` (op and microbatch), `F3c5` when a stage holds several chunks or not the
    chunk of its own number (chunk 5), and `.` when the stage is idle. Then each row's name
    says which chunks the stage holds: `stage 0 (c0 c7)`.
    """
    grid = schedule.grid()
    cells = [[_IDLE if a is None else _label(schedule, a) for a in row] for row in grid]
    width = max(len(str(schedule.ticks - 1)), *(len(cell) for row in cells for cell in row))
    names = [_stage_name(schedule, stage) for stage in range(schedule.stages)]
    margin = max(len(name) for name in [*names, "tick"])
    ticks = " ".join(str(tick).ljust(width) for tick in range(schedule.ticks))
    lines = [_title(schedule), f"{'tick'.ljust(margin)}  {ticks}"]
    lines += [
        f"{name.ljust(margin)}  {' '.join(cell.ljust(width) for cell in row)}"
        for name, row in zip(names, cells, strict=True)
    ]
    lines.append(_summary(schedule))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def tick_legend(schedule: Schedule) -> str:
    """What one column of the timeline is, with the actions this schedule uses."""
    used = {action.op for row in schedule.actions_by_stage for action in row}
    ops = ", ".join(f"{op.value} {_op_name(op)}" for op in Op if op in used)
    return (
        f"a tick: each stage runs at most one action ({ops}) on one microbatch of one chunk; the stages keep "
        "step, so a tick lasts as long as its slowest action (`dslc plan` estimates a step in seconds)"
    )


def to_json(schedule: Schedule) -> dict[str, object]:
    """The schedule as JSON-ready data; `actions[s]` lists stage `s`'s actions in tick order."""
    return {
        "kind": schedule.kind,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "virtual": schedule.virtual,
        "placement": list(schedule.placement),
        "ticks": schedule.ticks,
        "bubble_fraction": schedule.bubble_fraction,
        "peak_in_flight": list(schedule.peak_in_flight),
        "actions": [
            [
                {
                    "tick": action.tick,
                    "op": action.op.value,
                    "microbatch": action.microbatch,
                    "chunk": action.chunk,
                }
                for action in row
            ]
            for row in schedule.actions_by_stage
        ],
    }


_CELL_HEIGHT = 24
_CHAR_WIDTH = 8  # a generous width of one 12px monospace character
_TITLE_HEIGHT = 24
_TICKS_HEIGHT = 18
_LEGEND_HEIGHT = 30


def to_svg(schedule: Schedule) -> str:
    """A self-contained SVG: one row per stage, one cell per tick, coloured by op.

    Each cell shows the microbatch (and chunk, when there are several per stage) and carries a
    tooltip naming the whole action; a legend of the ops used sits underneath.
    """
    grid = schedule.grid()
    labels = [_cell_text(schedule, a) for row in grid for a in row if a is not None]
    cell_width = max(28, _CHAR_WIDTH * max(len(text) for text in labels) + 8)
    margin = _CHAR_WIDTH * max(len(_stage_name(schedule, stage)) for stage in range(schedule.stages)) + 12
    rows_top = _TITLE_HEIGHT + _TICKS_HEIGHT
    legend_top = rows_top + schedule.stages * _CELL_HEIGHT + 8
    heading = f"{_title(schedule)}; {_summary(schedule)}"

    used = {action.op for row in schedule.actions_by_stage for action in row}
    legend = [(f"{op.value} {_op_name(op)}", _colour(op)) for op in Op if op in used]
    legend.append((f"{_IDLE} idle", "#eeeeee"))
    legend_x = [4]
    for caption, _ in legend:
        legend_x.append(legend_x[-1] + 18 + _CHAR_WIDTH * len(caption) + 16)

    # Wide enough for the grid, the heading and the legend, whichever is widest.
    width = max(margin + cell_width * schedule.ticks, _CHAR_WIDTH * len(heading), legend_x[-1]) + 8
    height = legend_top + _LEGEND_HEIGHT
    svg = ET.Element(
        "svg",
        {
            "xmlns": "http://www.w3.org/2000/svg",
            "width": str(width),
            "height": str(height),
            "viewBox": f"0 0 {width} {height}",
            "font-family": "monospace",
            "font-size": "12",
        },
    )
    ET.SubElement(svg, "title").text = _title(schedule)
    _text(svg, 4, 16, heading)
    for tick in range(schedule.ticks):
        x = margin + tick * cell_width + cell_width // 2
        _text(svg, x, rows_top - 5, str(tick), anchor="middle", size="10")

    for stage, row in enumerate(grid):
        y = rows_top + stage * _CELL_HEIGHT
        _text(svg, 4, y + 16, _stage_name(schedule, stage))
        for tick, action in enumerate(row):
            x = margin + tick * cell_width
            fill = "#eeeeee" if action is None else _colour(action.op)
            cell = _rect(svg, x, y, cell_width, _CELL_HEIGHT, fill)
            if action is not None:
                ET.SubElement(cell, "title").text = (
                    f"stage {stage}, tick {tick}: {_op_name(action.op)}, "
                    f"microbatch {action.microbatch}, chunk {action.chunk}"
                )
                text = _cell_text(schedule, action)
                _text(svg, x + cell_width // 2, y + 16, text, anchor="middle", fill="#ffffff")

    for (caption, fill), x in zip(legend, legend_x[:-1], strict=True):
        _rect(svg, x, legend_top, 14, 14, fill)
        _text(svg, x + 18, legend_top + 12, caption)

    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode") + "\n"


def _label(schedule: Schedule, action: Action) -> str:
    return f"{action.op.value}{_cell_text(schedule, action)}"


def _cell_text(schedule: Schedule, action: Action) -> str:
    if not _shows_chunks(schedule):
        return str(action.microbatch)
    return f"{action.microbatch}c{action.chunk}"


def _shows_chunks(schedule: Schedule) -> bool:
    """Whether the picture needs chunk numbers: not when stage s holds chunk s alone."""
    return schedule.placement != tuple(range(schedule.stages))


def _stage_name(schedule: Schedule, stage: int) -> str:
    if not _shows_chunks(schedule):
        return f"stage {stage}"
    return f"stage {stage} ({' '.join(f'c{chunk}' for chunk in schedule.chunks_of(stage))})"


def _title(schedule: Schedule) -> str:
    return (
        f"{schedule.kind}: {_count(schedule.stages, 'stage', 'stages')}, "
        f"{_count(schedule.microbatches, 'microbatch', 'microbatches')}, "
        f"{_count(schedule.virtual, 'chunk', 'chunks')} per stage"
    )


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def _summary(schedule: Schedule) -> str:
    return (
        f"{schedule.ticks} ticks, bubble fraction {schedule.bubble_fraction:.3f}, "
        f"peak in flight {list(schedule.peak_in_flight)}"
    )


def _op_name(op: Op) -> str:
    match op:
        case Op.FORWARD:
            return "forward"
        case Op.BACKWARD:
            return "backward"
        case Op.INPUT_GRAD:
            return "input gradient"
        case Op.WEIGHT_GRAD:
            return "weight gradient"
        case _:
            assert_never(op)


def _colour(op: Op) -> str:
    match op:
        case Op.FORWARD:
            return "#4c78a8"
        case Op.BACKWARD:
            return "#f58518"
        case Op.INPUT_GRAD:
            return "#e45756"
        case Op.WEIGHT_GRAD:
            return "#54a24b"
        case _:
            assert_never(op)


def _rect(parent: ET.Element, x: int, y: int, width: int, height: int, fill: str) -> ET.Element:
    return ET.SubElement(
        parent,
        "rect",
        x=str(x),
        y=str(y),
        width=str(width),
        height=str(height),
        fill=fill,
        stroke="#ffffff",
    )


def _text(
    parent: ET.Element,
    x: int,
    y: int,
    content: str,
    anchor: str = "start",
    size: str = "12",
    fill: str = "#222222",
) -> None:
    element = ET.SubElement(
        parent,
        "text",
        {"x": str(x), "y": str(y), "fill": fill, "text-anchor": anchor, "font-size": size},
    )
    element.text = content
