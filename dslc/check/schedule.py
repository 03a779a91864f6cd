"""The schedule's own constraints, as the schedule generator states them."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics
from dslc.ir.nodes import Program
from dslc.schedules import KINDS, ScheduleError, build


def check_schedule(program: Program, diags: Diagnostics) -> None:
    p = program.pipeline
    if p is None or p.schedule not in KINDS:
        return
    stages = program.mesh.size((p.axis,))
    try:
        build(p.schedule, stages, p.microbatches, p.virtual)
    except ScheduleError as exc:
        diags.error(
            "E022",
            str(exc),
            p.span,
            notes=[f"{stages} stages (`{p.axis}`), {p.microbatches} microbatches, virtual {p.virtual}"],
        )
