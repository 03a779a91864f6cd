"""Every scalar of `metrics.jsonl`, also where dashboards read it: TensorBoard, and W&B on request.

TensorBoard's event files go to `RUN/tensorboard/` (written by tensorboardX, a small writer
without TensorFlow; `tensorboard --logdir RUN` shows them beside the `--profile` trace). A
resumed run starts a new event file that purges the steps after its checkpoint, so the
dashboard shows each step once, as `metrics.jsonl` does. With `--wandb`, the same scalars
go to a Weights & Biases run named after the run folder (the `wandb` package, installed by
the user; `WANDB_MODE=offline` keeps it on disk without a network).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

BOARD_DIR = "tensorboard"


class DashboardError(Exception):
    """A dashboard the user asked for cannot be used."""


class Dashboards:
    """The dashboards of one run folder, written by the process that reports the run."""

    def __init__(self, out: Path, resumed_after: int, wandb: bool = False, config: Mapping[str, Any] | None = None):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard drops what an earlier writer logged from this step on.
        self._board = SummaryWriter(str(out / BOARD_DIR), purge_step=resumed_after + 1 if resumed_after else None)
        self._wandb: Any = _start_wandb(out, dict(config or {})) if wandb else None

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        """The numbers among `scalars` (booleans, nulls and the step itself left out) at `step`."""
        numbers = {
            k: float(v)
            for k, v in scalars.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
        }
        for name, value in numbers.items():
            self._board.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def flush(self) -> None:
        self._board.flush()

    def close(self) -> None:
        self._board.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_missing() -> str | None:
    """Why `--wandb` cannot be used here, or None."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return (
            "--wandb needs the wandb package: pip install wandb (WANDB_MODE=offline keeps runs on disk, "
            "without a network)"
        )
    return None


def _start_wandb(out: Path, config: dict[str, Any]) -> Any:
    missing = wandb_missing()
    if missing:
        raise DashboardError(missing)
    import wandb

    # One W&B run per run folder: a resumed run continues it.
    name = out.resolve().name
    return wandb.init(project="dslc", name=name, id=_run_id(out), resume="allow", dir=str(out), config=config)


def _run_id(out: Path) -> str:
    import hashlib

    return "dslc-" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]
