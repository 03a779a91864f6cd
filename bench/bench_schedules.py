"""Bubble fraction and activation memory of every schedule kind, read off the tables.

Run from the repository root: `python -m bench.bench_schedules`.

Columns: `ticks` is the table's makespan in unit ticks (every op one tick); `theory` is
`theoretical_bubble`; `table` is the table's own bubble fraction (idle stage-ticks over all);
`costed` re-times the same order with a whole backward costing two units and I, W one each,
so kinds with and without the split backward do the same work; `peak in flight` is the most
activations each stage holds at once.
"""

from __future__ import annotations

from dslc.schedules import build, retime, theoretical_bubble

VARIANTS = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1))
HEADER = ("P", "M", "kind", "V", "ticks", "theory", "table", "costed", "peak in flight")


def rows() -> list[tuple[str, ...]]:
    table: list[tuple[str, ...]] = []
    for stages in (2, 4, 8):
        for microbatches in (stages, 2 * stages, 4 * stages):
            for kind, virtual in VARIANTS:
                schedule = build(kind, stages, microbatches, virtual)
                table.append(
                    (
                        str(stages),
                        str(microbatches),
                        kind,
                        str(virtual),
                        str(schedule.ticks),
                        f"{theoretical_bubble(kind, stages, microbatches, virtual):.3f}",
                        f"{schedule.bubble_fraction:.3f}",
                        f"{retime(schedule).bubble_fraction:.3f}",
                        " ".join(str(peak) for peak in schedule.peak_in_flight),
                    )
                )
    return table


def main() -> None:
    table = [HEADER, *rows()]
    widths = [max(len(row[column]) for row in table) for column in range(len(HEADER))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
