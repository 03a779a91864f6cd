"""What a person watches while a spec trains, on standard error.

On a terminal, a live `rich` progress bar with the step, loss, step time and throughput.
Elsewhere (a log file, CI) a live bar would be noise, so a plain line every tenth of the
run. Either way the first step a process runs is reported on its own: while it compiles the
display says so (it can take minutes for a large model), and its time is kept out of the
steady-state figures. Evaluations get a line each. In a multi-process run only process 0
shows anything; the others' progress is hidden (`shown=False`).
"""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainingProgress:
    """Steps `start + 1 .. total` of a run, as they finish."""

    def __init__(self, total: int, start: int, unit: str, shown: bool = True) -> None:
        self.total, self.start, self.unit, self.shown = total, start, unit, shown
        self._console = Console(file=sys.stderr)
        self.every = max((total - start) // 10, 1)  # steps between the lines without a terminal
        self._bar: Progress | None = None
        if shown and self._console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[step_ms]} ms/step"),
                TextColumn("{task.fields[rate]} " + unit + "/s"),
                TextColumn("{task.fields[flops]}"),
                TextColumn("{task.fields[experts]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._bar.add_task(
                "compiling the first step",
                total=total,
                completed=start,
                loss="-",
                step_ms="-",
                rate="-",
                flops="",
                experts="",
            )

    def __enter__(self) -> TrainingProgress:
        if self._bar is not None:
            self._bar.start()
        elif self.shown and self.start < self.total:
            self._console.print(f"step {self.start + 1}: compiling the training step ...", highlight=False)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def step(
        self,
        step: int,
        loss: float,
        step_time_s: float,
        per_s: float,
        compiled: bool,
        tflops: float,
        mfu: float | None,
    ) -> None:
        """A finished step; `tflops` of model FLOPs per device, `mfu` None where no peak is known."""
        rate = f"{tflops:.3g} TFLOP/s/device" + (f"  MFU {mfu:.1%}" if mfu is not None else "")
        if not self.shown:
            return
        if compiled:
            self._console.print(f"step {step}: compiled and ran in {step_time_s:.2f} s, loss {loss:.4f}")
        if self._bar is not None:
            self._bar.update(
                self._task,
                description="step",
                completed=step,
                loss=f"{loss:.4f}",
                step_ms=f"{step_time_s * 1e3:.0f}",
                rate=f"{per_s:,.0f}",
                flops=rate,
            )
        elif not compiled and ((step - self.start) % self.every == 0 or step == self.total):
            timing = f"{step_time_s * 1e3:.0f} ms/step  {per_s:,.0f} {self.unit}/s  {rate}"
            self._console.print(f"step {step}/{self.total}  loss {loss:.4f}  {timing}", highlight=False)

    def routed(self, step: int, figures: dict[str, float]) -> None:
        """A mixture of experts' load on a step's batch (`dslc.runtime.metrics.moe_metrics`)."""
        if not self.shown or not figures:
            return
        busiest = f"busiest expert {figures['moe_load_max']:.2f}x its share"
        if self._bar is not None:
            self._bar.update(self._task, experts=busiest)
            return
        parts = [busiest, f"{figures['moe_dropped_fraction']:.1%} dropped"]
        parts += [f"balance loss {figures['moe_balance_loss']:.4f}"] if figures["moe_balance_loss"] else []
        parts += [f"z-loss {figures['moe_z_loss']:.4f}"] if figures["moe_z_loss"] else []
        self._console.print(f"step {step}: experts: {', '.join(parts)}", highlight=False, soft_wrap=True)

    def evaluated(self, step: int, loss: float, accuracy: float | None = None) -> None:
        if self.shown:
            said = f"step {step}: held-out loss {loss:.4f}" + (
                f", accuracy {accuracy:.1%}" if accuracy is not None else ""
            )
            self._console.print(said, highlight=False)
