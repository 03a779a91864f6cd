"""The training loop: a compiled Program, the embedded data, metrics and checkpoints.

A run lives in one folder: `metrics.jsonl`, `loss.png` and `checkpoints/`. Step numbers
count optimizer steps done, so "step 3" is the state after three updates; checkpoint 3
resumes by running the step whose 0-based index is 3 (the fourth batch).

In a multi-process run (`distributed.py`) every process runs this same loop on the same
global batches and takes part in every checkpoint save (orbax writes each process's shards);
only process 0 reports: the log lines, the progress, the metrics and the loss curve.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dslc.lower.model import DslcModel
from dslc.lower.optim import learning_rate
from dslc.lower.program import Program, WeightsError
from dslc.train.checkpoint import Checkpoints, RunState, run_state
from dslc.train.data import dataset_for
from dslc.train.dataset import Dataset
from dslc.train.metrics import Metrics, Throughput
from dslc.train.progress import TrainingProgress

CHECKPOINTS_DIR = "checkpoints"


class TrainError(Exception):
    """A run that cannot start as asked (a folder, a checkpoint or a seed that does not fit)."""


@dataclass(frozen=True)
class TrainOptions:
    steps: int  # train until this many optimizer steps are done
    out: Path  # the run folder
    seed: int | None = None  # None: 0 for a new run, the checkpoint's when resuming
    checkpoint_every: int | None = None  # besides the checkpoint at the end
    resume: bool = False
    init_from: Mapping[str, np.ndarray] | None = None  # weights a new run starts from, by dotted name


@dataclass(frozen=True)
class TrainResult:
    model: str
    mesh: str
    data: str
    out: Path
    start: int  # steps done before this process began
    losses: dict[int, float]  # step -> loss, for the steps this process ran
    first_step_s: float | None  # the step that compiled, or None when none ran
    steady: Throughput | None
    unit: str
    checkpoint: int | None  # the newest checkpoint's step
    leader: bool  # this process reports the run: the only one, or process 0 of several

    def summary(self) -> str:
        if not self.losses:
            return f"{self.out}: checkpoint {self.start} already reaches the requested steps; nothing to do"
        steps = sorted(self.losses)
        lines = [
            f"trained {self.model} on mesh {self.mesh}, steps {steps[0]}-{steps[-1]}: "
            f"loss {self.losses[steps[0]]:.4f} -> {self.losses[steps[-1]]:.4f}",
            f"first step (compilation included): {self.first_step_s:.2f} s",
        ]
        if self.steady is not None:
            lines.append(
                f"steady state over {self.steady.steps} steps: {self.steady.step_time_s * 1e3:.1f} ms/step, "
                f"{self.steady.per_s:,.0f} {self.unit}/s"
            )
        lines.append(f"wrote {self.out}/metrics.jsonl, {self.out}/loss.png, checkpoint {self.checkpoint}")
        return "\n".join(lines)


def train(program: Program, options: TrainOptions, log: Callable[[str], None] | None = None) -> TrainResult:
    """Train `program` on its embedded data set as `options` say. `log` (standard error by
    default, beside the progress display) gets what a person should read before it starts;
    in a multi-process run only process 0 logs."""
    leader = jax.process_index() == 0
    log = (log or _to_stderr) if leader else _nowhere
    dataset = dataset_for(program.ir)
    checkpoints = _open_run(options.out)
    try:
        return _train(program, dataset, checkpoints, options, log, leader)
    finally:
        checkpoints.close()


def _open_run(out: Path) -> Checkpoints:
    try:
        (out / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"cannot use {out} as the run folder: {exc.strerror or exc}") from None
    return Checkpoints(out / CHECKPOINTS_DIR)


def _train(
    program: Program,
    dataset: Dataset,
    checkpoints: Checkpoints,
    options: TrainOptions,
    log: Callable[[str], None],
    leader: bool,
) -> TrainResult:
    latest = checkpoints.latest_step()
    if options.resume and latest is None:
        raise TrainError(f"no checkpoint in {checkpoints.directory} to resume from; train without --resume first")
    if not options.resume and latest is not None:
        raise TrainError(
            f"{options.out} already holds a checkpoint at step {latest}: add --resume to continue from it, "
            "or choose another --out"
        )
    saved = _saved_state(checkpoints, latest)
    if saved is not None and options.seed is not None and options.seed != saved.seed:
        raise TrainError(
            f"the checkpoint was trained with seed {saved.seed}, not {options.seed}: leave --seed out when resuming"
        )
    seed = saved.seed if saved is not None else options.seed or 0
    model = program.init(seed)
    if options.init_from is not None and saved is None:
        _start_from(program, model, options.init_from)
    opt_state = program.init_optimizer(model)
    here = _state(program, dataset, model, opt_state, seed, 0)
    start = 0
    if saved is not None:
        problems = saved.mismatch(here)
        if problems:
            raise TrainError(
                f"the checkpoint at step {saved.step} in {checkpoints.directory} is not of this spec: "
                + "; ".join(problems)
                + ". Resume with the spec and --set values it was trained with, or choose another --out"
            )
        opt_state = checkpoints.restore(saved.step, model, opt_state)
        start = saved.data_position
        moved = "" if saved.mesh == here.mesh else f", resharded from mesh {saved.mesh}"
        log(f"resumed from the checkpoint at step {saved.step}{moved}")
        if saved.data_fingerprint != dataset.fingerprint:
            log(
                f"warning: the data differ from the checkpoint's ({saved.data}; another Python version?): "
                "the loss will not follow the uninterrupted run's"
            )
    log(f"training {program.ir.name} on mesh {here.mesh}: {dataset.description}, seed {seed}")

    metrics = Metrics.resume(options.out, dataset.unit, start, writes=leader)
    schedule = learning_rate(program.ir.train.optimizer)
    losses: dict[int, float] = {}
    first_step_s = None
    newest = latest
    try:
        with TrainingProgress(options.steps, start, dataset.unit, shown=leader) as progress:
            for index in range(start, options.steps):
                batch = dataset.batch(seed, index)
                began = time.perf_counter()
                opt_state, loss = program.train_step(model, opt_state, batch, index)
                seconds = time.perf_counter() - began
                step, compiled = index + 1, index == start
                first_step_s = seconds if compiled else first_step_s
                losses[step] = loss
                metrics.add(step, loss, seconds, dataset.per_batch, float(schedule(index)), compiled)
                progress.step(step, loss, seconds, dataset.per_batch / seconds, compiled)
                every = options.checkpoint_every
                if step == options.steps or (every is not None and step % every == 0):
                    checkpoints.save(model, opt_state, _state(program, dataset, model, opt_state, seed, step))
                    newest = step
                    metrics.write()
    except BaseException:
        if losses:  # what ran is worth keeping, even when the run stops early
            metrics.write()
        raise
    return TrainResult(
        model=program.ir.name,
        mesh=here.mesh,
        data=dataset.description,
        out=options.out,
        start=start,
        losses=losses,
        first_step_s=first_step_s,
        steady=metrics.throughput(since_step=start),
        unit=dataset.unit,
        checkpoint=newest,
        leader=leader,
    )


def _start_from(program: Program, model: DslcModel, weights: Mapping[str, np.ndarray]) -> None:
    """Replace the fresh weights with the given ones, all checked before any is replaced."""
    try:
        program.import_weights(model, weights)
    except WeightsError as exc:
        raise TrainError(f"--init-from: {exc}") from None


def _saved_state(checkpoints: Checkpoints, step: int | None) -> RunState | None:
    if step is None:
        return None
    try:
        return checkpoints.run_state(step)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # not written by `dslc train`, or damaged
        raise TrainError(f"cannot read the checkpoint at step {step} in {checkpoints.directory}: {exc}") from None


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _nowhere(line: str) -> None:
    """The log of a process other than the first: process 0 has said the same."""


def _state(program: Program, dataset: Dataset, model: DslcModel, opt_state: Any, seed: int, step: int) -> RunState:
    return run_state(
        model,
        opt_state,
        step=step,
        seed=seed,
        data_position=step,
        data=dataset.description,
        data_fingerprint=dataset.fingerprint,
        spec=program.ir.name,
        mesh=program.ir.mesh.describe(),
    )
