"""Per-step training metrics: one JSON object a line in `metrics.jsonl`, and the loss curve.

Keys of each line: `step` (optimizer steps done, from 1), `loss` (on that step's batch,
before its update), `grad_norm` (the global L2 norm of the step's gradients),
`step_time_s` (wall time of the step, the loss fetched), `tokens_per_s` or `samples_per_s`
(whichever the data set counts), `lr` (the learning rate the step used), `model_flops`,
`tflops_per_device`, `mfu` and `peak_tflops` (dslc.train.utilization) and `compiled` (true
on the first step a process runs, whose time includes compilation). A step that evaluated
(`--eval-every`) also has `eval_loss`, the mean loss on held-out batches after the step,
and for a mixture of experts `eval_moe_balance_loss`, `eval_moe_z_loss`,
`eval_moe_dropped_fraction` and `eval_moe_load_max` on them; every tenth step of a run (and its
last) has the same without `eval_` on its own batch (the busiest expert's load over the mean,
`moe_load_max`, is what to watch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslc.files import write_atomic
from dslc.train.dashboards import Dashboards
from dslc.train.plot import loss_curve_png

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss.png"


@dataclass(frozen=True)
class Throughput:
    """Steady state over the steps a process ran, compilation excluded."""

    steps: int
    step_time_s: float
    per_s: float


@dataclass
class Metrics:
    """The rows of one run folder, rewritten whole (and atomically) on every `write`.

    `writes` is false in the processes of a multi-process run other than the first: they
    share the folder, and one writer keeps the file that of one process's timings."""

    directory: Path
    unit: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    writes: bool = True
    # Where every scalar also goes (TensorBoard, W&B), in the process that writes.
    dashboards: Dashboards | None = None

    @classmethod
    def resume(
        cls, directory: Path, unit: str, step: int, writes: bool = True, dashboards: Dashboards | None = None
    ) -> Metrics:
        """The rows an earlier process wrote up to `step`, the checkpoint being resumed (0 for
        a new run): rows past it belong to steps that will run again."""
        path = directory / METRICS_FILE
        rows = list(_read_rows(path)) if path.is_file() else []
        return cls(directory, unit, [r for r in rows if r["step"] <= step], writes, dashboards)

    def add(
        self,
        step: int,
        step_time_s: float,
        per_batch: int,
        lr: float,
        compiled: bool,
        figures: Mapping[str, float | None],
    ) -> None:
        """A step's row; `figures` holds its `loss` and whatever else the step measured."""
        self.rows.append(
            {
                "step": step,
                "loss": figures["loss"],
                **{k: v for k, v in figures.items() if k != "loss"},
                "step_time_s": step_time_s,
                f"{self.unit}_per_s": per_batch / step_time_s,
                "lr": lr,
                "compiled": compiled,
            }
        )
        if self.dashboards is not None:
            self.dashboards.log(step, self.rows[-1])

    def annotate(self, figures: dict[str, float]) -> None:
        """Add figures measured after the newest step (an evaluation) to its row."""
        self.rows[-1].update(figures)
        if self.dashboards is not None:
            self.dashboards.log(self.rows[-1]["step"], figures)

    def write(self) -> None:
        if not self.writes:
            return
        text = "".join(json.dumps(r) + "\n" for r in self.rows)
        write_atomic(self.directory / METRICS_FILE, text)
        steps = [r["step"] for r in self.rows]
        evaluated = [(r["step"], r["eval_loss"]) for r in self.rows if "eval_loss" in r]
        curve = loss_curve_png(steps, [r["loss"] for r in self.rows], evaluated)
        write_atomic(self.directory / CURVE_FILE, curve)
        if self.dashboards is not None:
            self.dashboards.flush()

    def close(self) -> None:
        if self.dashboards is not None:
            self.dashboards.close()

    def throughput(self, since_step: int) -> Throughput | None:
        """Steady state over the steps after `since_step`, or None before any ran."""
        steady = [r for r in self.rows if r["step"] > since_step and not r["compiled"]]
        if not steady:
            return None
        seconds = sum(r["step_time_s"] for r in steady)
        per_s = sum(r[f"{self.unit}_per_s"] * r["step_time_s"] for r in steady) / seconds
        return Throughput(len(steady), seconds / len(steady), per_s)


def _read_rows(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a hand-edited line: losing it must not stop a resume
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            yield row
