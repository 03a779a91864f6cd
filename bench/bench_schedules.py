"""Bubble fraction and activation memory of every schedule kind, read off the tables, next to
`torch.distributed.pipelining`'s zero-bubble V schedules replayed on the same clock.

Run from the repository root: `python -m bench.bench_schedules`.

Columns: `ticks` is the table's makespan in unit ticks (every op one tick); `theory` is
`theoretical_bubble` (`-` where the kind has none); `table` is the table's own bubble fraction
(idle stage-ticks over all); `costed` re-times the same order on the clock where a forward
costs 1, a whole backward 2 and each half of a split one 1, so kinds with and without the split
backward do the same work; `floor` is the least bubble any table with that many chunks per
stage can have on that clock ((P-1)/(3VM+P-1): the last stage starts P-1 late and then works
3VM units); `torch` is the issue's figure for `ScheduleZBVZeroBubble` on that clock, where it
quoted one. `peak in flight` is the most chunk inputs each stage holds from a forward to its
backward (B or I), `stash` the executor's slots for them (held until W), and `of 1f1b` the
busiest stage's peak in whole-stage microbatches (chunk inputs / chunks per stage) over
1F1B's.

Then, for pipelines far too large to tabulate (64 stages by up to 2^20 microbatches), the
seconds `dslc.analyze` and `dslc.plan.plan` take, and their ratio to the same spec with 64
microbatches measured in the same run: closed forms keep them flat.
"""

from __future__ import annotations

import time

import dslc
from dslc.plan import plan
from dslc.schedules import build, retime, theoretical_bubble
from dslc.schedules.buffers import allocate_slots

VARIANTS = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 3),
    ("zb-h1", 1),
    ("zb-v", 2),
    ("v-half", 2),
)
# ScheduleZBVZeroBubble (and ScheduleInterleavedZeroBubble) replayed on F=1, B=2, I=W=1: (P, M) -> bubble.
TORCH_ZBV = {(4, 8): 0.059, (4, 16): 0.030, (8, 16): 0.068, (8, 24): 0.046}
HEADER = (
    "P",
    "M",
    "kind",
    "V",
    "ticks",
    "theory",
    "table",
    "costed",
    "floor",
    "torch",
    "peak in flight",
    "stash",
    "of 1f1b",
)


def rows() -> list[tuple[str, ...]]:
    table: list[tuple[str, ...]] = []
    for stages in (2, 4, 8):
        for microbatches in (stages, 2 * stages, 3 * stages, 4 * stages):
            one_f_one_b = max(build("1f1b", stages, microbatches).peak_in_flight)
            for kind, virtual in VARIANTS:
                schedule = build(kind, stages, microbatches, virtual)
                theory = theoretical_bubble(kind, stages, microbatches, virtual)
                floor = (stages - 1) / (3 * virtual * microbatches + stages - 1)
                torch = TORCH_ZBV.get((stages, microbatches)) if kind == "zb-v" else None
                table.append(
                    (
                        str(stages),
                        str(microbatches),
                        kind,
                        str(virtual),
                        str(schedule.ticks),
                        "-" if theory is None else f"{theory:.3f}",
                        f"{schedule.bubble_fraction:.3f}",
                        f"{retime(schedule).bubble_fraction:.4f}",
                        f"{floor:.4f}",
                        "-" if torch is None else f"{torch:.3f}",
                        " ".join(str(peak) for peak in schedule.peak_in_flight),
                        str(allocate_slots(schedule).stash_slots),
                        f"{max(schedule.peak_in_flight) / virtual / one_f_one_b:.2f}",
                    )
                )
    return table


WIDE = """model wide
mesh data=1, stage=64
input x: f32[MICROBATCHES @ data, 16]
input y: f32[MICROBATCHES @ data, 16]
forward(x) {
  stages {
    repeat 128 linear(16, 16)
  }
  loss: mse(y)
}
pipeline stage {
  schedule KIND
  microbatches MICROBATCHES
}
"""


def check_and_plan_seconds(kind: str, microbatches: int) -> tuple[float, float]:
    """The best of three: `dslc.analyze` (as `dslc plan` runs it) and `plan` of the 64-stage spec."""
    text = WIDE.replace("KIND", kind).replace("MICROBATCHES", str(microbatches))
    checks, plans = [], []
    for _ in range(3):
        started = time.perf_counter()
        analysis = dslc.analyze(text, running=False)
        checked = time.perf_counter()
        assert analysis.ok and analysis.program is not None, analysis.diagnostics
        plan(analysis.program)
        checks.append(checked - started)
        plans.append(time.perf_counter() - checked)
    return min(checks), min(plans)


def print_table(table: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def main() -> None:
    print_table([HEADER, *rows()])
    print()
    sizes: list[tuple[str, ...]] = [("kind", "P", "M", "check s", "x M=64", "plan s", "x M=64")]
    for kind in ("1f1b", "zb-v"):
        base_check, base_plan = check_and_plan_seconds(kind, 64)
        for microbatches in (64, 8192, 1 << 20):
            check, planned = check_and_plan_seconds(kind, microbatches)
            sizes.append(
                (
                    kind,
                    "64",
                    str(microbatches),
                    f"{check:.4f}",
                    f"{check / base_check:.2f}",
                    f"{planned:.4f}",
                    f"{planned / base_plan:.2f}",
                )
            )
    print_table(sizes)


if __name__ == "__main__":
    main()
