"""The training loop: a compiled Program, its data, metrics, evaluation and checkpoints.

A run lives in one folder: `metrics.jsonl`, `loss.png` and `checkpoints/`. Step numbers
count optimizer steps done, so "step 3" is the state after three updates; checkpoint 3
resumes by running the step whose 0-based index is 3 (the fourth batch).

In a multi-process run (`distributed.py`) every process runs this same loop on the same
global batches, reading only its own rows of each, and takes part in every checkpoint save
(orbax writes each process's shards) and every evaluation; only process 0 reports: the log
lines, the progress, the metrics and the loss curve.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from signal import Signals
from typing import Any

import jax
import numpy as np

from dslc.ir import nodes as ir
from dslc.layers import RULES, args
from dslc.layers.loss import CrossEntropy, CrossEntropyArgs
from dslc.lower.program import DslcModel, Program, WeightsError
from dslc.plan.flops import flops as plan_flops
from dslc.runtime.metrics import moe_metrics
from dslc.train.checkpoint import Checkpoints, RunState, run_state
from dslc.train.dashboards import Dashboards
from dslc.train.data import data_notes, data_warnings, dataset_for
from dslc.train.dataset import Dataset
from dslc.train.distributed import local_rows
from dslc.train.interrupt import StopRequest
from dslc.train.metrics import Metrics, Throughput
from dslc.train.profile import PROFILE_DIR, ProfileWindow
from dslc.train.progress import TrainingProgress
from dslc.train.utilization import Utilization, peak_for

CHECKPOINTS_DIR = "checkpoints"
# Held-out batches per evaluation: the same ones every time, so the eval losses compare.
EVAL_BATCHES = 8


class TrainError(Exception):
    """A run that cannot start as asked (a folder, a checkpoint or a seed that does not fit)."""


class TrainInterrupted(Exception):
    """Ctrl-C or SIGTERM (`signal`, its number) stopped the run after step `step`, whose
    checkpoint is saved."""

    def __init__(self, step: int, signal: int = int(Signals.SIGINT)) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step
        self.signal = signal


def agreed(requested: int) -> int:
    """The stop every process of the run makes after this step: the signal any of them got
    (0 for none). A process that stopped alone would leave the others waiting for it in their
    next step's collectives, and its checkpoint, which every process writes its shards of,
    unfinished; so each step the processes tell one another."""
    if jax.process_count() == 1:
        return requested
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(requested, np.int32))))


@dataclass(frozen=True)
class TrainOptions:
    steps: int  # train until this many optimizer steps are done
    out: Path  # the run folder
    seed: int | None = None  # None: 0 for a new run, the checkpoint's when resuming
    checkpoint_every: int | None = None  # besides the checkpoint at the end
    resume: bool = False
    data: Path | None = None  # the user's own tokens or text, or images and labels, instead of the embedded data
    eval_every: int | None = None  # evaluate on the held-out data every K steps (and at the end)
    init_from: Mapping[str, np.ndarray] | None = None  # weights a new run starts from, by dotted name
    document_end: int | None = None  # in a token file, the id that ends a document
    device_flops: float | None = None  # TFLOP/s per device MFU is measured against, instead of the table's
    profile: tuple[int, int] | None = None  # trace steps START to STOP with the JAX profiler
    wandb: bool = False  # also log the scalars to a Weights & Biases run
    async_checkpoints: bool = True  # write each checkpoint while the next steps compute


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
    eval_losses: dict[int, float] = field(default_factory=dict)
    eval_accuracies: dict[int, float] = field(default_factory=dict)  # a classifier's, on the held-out data
    utilization: Utilization | None = None  # what the steps are measured against

    def summary(self) -> str:
        if not self.losses:
            return f"{self.out}: checkpoint {self.start} already reaches the requested steps; nothing to do"
        steps = sorted(self.losses)
        lines = [
            f"trained {self.model} on mesh {self.mesh}, steps {steps[0]}-{steps[-1]}: "
            f"loss {self.losses[steps[0]]:.4f} -> {self.losses[steps[-1]]:.4f}",
            f"first step (compilation included): {self.first_step_s:.2f} s",
        ]
        if self.eval_losses:
            evals = sorted(self.eval_losses)
            lines.append(
                f"held-out loss at step {evals[0]}: {self.eval_losses[evals[0]]:.4f}"
                + (f", at step {evals[-1]}: {self.eval_losses[evals[-1]]:.4f}" if len(evals) > 1 else "")
            )
        if self.eval_accuracies:
            evals = sorted(self.eval_accuracies)
            lines.append(
                f"held-out accuracy at step {evals[0]}: {self.eval_accuracies[evals[0]]:.1%}"
                + (f", at step {evals[-1]}: {self.eval_accuracies[evals[-1]]:.1%}" if len(evals) > 1 else "")
            )
        if self.steady is not None:
            lines.append(
                f"steady state over {self.steady.steps} steps: {self.steady.step_time_s * 1e3:.1f} ms/step, "
                f"{self.steady.per_s:,.0f} {self.unit}/s"
            )
            if self.utilization is not None:
                lines.append(self.utilization.describe(self.steady.step_time_s))
        lines.append(f"wrote {self.out}/metrics.jsonl, {self.out}/loss.png, checkpoint {self.checkpoint}")
        return "\n".join(lines)


def train(program: Program, options: TrainOptions, log: Callable[[str], None] | None = None) -> TrainResult:
    """Train `program` on its data as `options` say. `log` (standard error by default, beside
    the progress display) gets what a person should read before it starts; in a
    multi-process run only process 0 logs. Ctrl-C finishes the step under way, saves it and
    raises TrainInterrupted; a second one stops at once, logs which checkpoint is kept,
    removes the one half-written, and lets KeyboardInterrupt through."""
    leader = jax.process_index() == 0
    log = (log or _to_stderr) if leader else _nowhere
    dataset = dataset_for(program.ir, options.data, options.document_end)
    if options.eval_every is not None and dataset.held_out is None:
        raise TrainError(f"--eval-every needs held-out data, and {dataset.description} keeps none")
    if options.resume and not _has_entries(options.out / CHECKPOINTS_DIR):
        raise _nothing_to_resume(options.out / CHECKPOINTS_DIR)  # before anything is created
    checkpoints = _open_run(options.out, options.async_checkpoints)
    try:
        return _train(program, dataset, checkpoints, options, log, leader)
    except KeyboardInterrupt:
        # A second Ctrl-C (or one before training began) stops inside a step or a save,
        # which may have committed its checkpoint or left it half-written. Closing waits for
        # a save already writing in the background, which then commits.
        checkpoints.close()
        log(_stopped_at_once(checkpoints, checkpoints.committed_step()))
        raise
    finally:
        checkpoints.close()


def _open_run(out: Path, asynchronous: bool) -> Checkpoints:
    try:
        (out / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"cannot use {out} as the run folder: {exc.strerror or exc}") from None
    return Checkpoints(out / CHECKPOINTS_DIR, asynchronous)


def has_checkpoints(out: Path) -> bool:
    """Whether the run folder `out` holds a checkpoint to resume from."""
    return _has_entries(out / CHECKPOINTS_DIR)


def _has_entries(directory: Path) -> bool:
    try:
        return any(directory.iterdir())
    except OSError:  # missing, or not a folder: _open_run says which
        return False


def _nothing_to_resume(directory: Path) -> TrainError:
    return TrainError(f"no checkpoint in {directory} to resume from; train without --resume first")


@dataclass
class _Run:
    """A run's state between steps."""

    model: DslcModel
    opt_state: Any
    seed: int
    start: int  # steps done before this process began
    mesh: str


def _start(
    program: Program, dataset: Dataset, checkpoints: Checkpoints, options: TrainOptions, log: Callable[[str], None]
) -> _Run:
    """A fresh model, or the newest checkpoint's when resuming, after checking that it fits."""
    latest = checkpoints.latest_step()
    if options.resume and latest is None:
        raise _nothing_to_resume(checkpoints.directory)
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
    run = _Run(model, program.init_optimizer(model), seed, 0, program.ir.mesh.describe())
    if saved is None:
        return run
    problems = saved.mismatch(_state(program, dataset, run, 0))
    if problems:
        raise TrainError(
            f"the checkpoint at step {saved.step} in {checkpoints.directory} is not of this spec: "
            + "; ".join(problems)
            + ". Resume with the spec and --set values it was trained with, or choose another --out"
        )
    run.opt_state = checkpoints.restore(saved.step, model, run.opt_state)
    run.start = saved.data_position
    moved = "" if saved.mesh == run.mesh else f", resharded from mesh {saved.mesh}"
    log(f"resumed from the checkpoint at step {saved.step}{moved}")
    if saved.data_fingerprint != dataset.fingerprint:
        log(
            f"warning: the data differ from the checkpoint's ({saved.data}): "
            "the loss will not follow the uninterrupted run's"
        )
    return run


def _train(
    program: Program,
    dataset: Dataset,
    checkpoints: Checkpoints,
    options: TrainOptions,
    log: Callable[[str], None],
    leader: bool,
) -> TrainResult:
    run = _start(program, dataset, checkpoints, options, log)
    log(f"training {program.ir.name} on mesh {run.mesh}: {dataset.description}, seed {run.seed}")
    for line in (*data_notes(dataset), *data_warnings(program.ir)):
        log(line)
    rows = local_rows(program)
    utilization = _utilization(program, options.device_flops)
    window = _profile_window(options, run.start, log)
    config = {"spec": program.ir.name, "mesh": run.mesh, "data": dataset.description, "seed": run.seed}
    dashboards = Dashboards(options.out, run.start, options.wandb, config) if leader else None
    metrics = Metrics.resume(options.out, dataset.unit, run.start, writes=leader, dashboards=dashboards)
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    eval_accuracies: dict[int, float] = {}
    first_step_s = None
    newest = checkpoints.latest_step()
    routed = any(RULES[layer.kind].has_aux for layer in ir.all_layers(program.ir))
    step = run.start
    try:
        with (
            TrainingProgress(options.steps, run.start, dataset.unit, shown=leader) as progress,
            StopRequest(
                lambda name: log(f"{name}: stopping after this step; again to stop now, without saving")
            ) as stop,
        ):
            for index in range(run.start, options.steps):
                batch = dataset.batch(run.seed, index, rows)
                if window is not None:
                    window.before(index + 1)
                began = time.perf_counter()
                run.opt_state, figures = program.train_step_with_metrics(run.model, run.opt_state, batch, index)
                seconds = time.perf_counter() - began
                stopping = agreed(stop.requested)
                step, compiled = index + 1, index == run.start
                first_step_s = seconds if compiled else first_step_s
                losses[step] = figures["loss"]
                traced = window.after(step) if window is not None else None
                if traced is not None:
                    log(traced)
                row = {**figures, **utilization.figures(seconds)}
                metrics.add(step, seconds, dataset.per_batch, program.learning_rate(index), compiled, row)
                progress.step(
                    step,
                    figures["loss"],
                    seconds,
                    dataset.per_batch / seconds,
                    compiled,
                    utilization.tflops_per_device(seconds),
                    utilization.mfu(seconds),
                )
                last = step == options.steps or bool(stopping)
                if routed and (step % progress.every == 0 or last):
                    # The experts' load on this step's batch, after its update.
                    found = moe_metrics(program.aux(run.model, batch))
                    metrics.annotate(found)
                    progress.routed(step, found)
                every = options.eval_every
                if every is not None and (step % every == 0 or last):
                    assert dataset.held_out is not None, "train() refuses --eval-every without held-out data"
                    found = evaluate(program, run.model, dataset.held_out, run.seed, rows)
                    eval_losses[step] = found["eval_loss"]
                    if "eval_accuracy" in found:
                        eval_accuracies[step] = found["eval_accuracy"]
                    metrics.annotate(found)
                    progress.evaluated(step, found["eval_loss"], found.get("eval_accuracy"))
                every = options.checkpoint_every
                if last or (every is not None and step % every == 0):
                    checkpoints.save(run.model, run.opt_state, _state(program, dataset, run, step))
                    newest = step
                    metrics.write()
                    # A stop asked for during this save (a save takes long) is made now: the
                    # checkpoint it would otherwise wait one more step for is already here.
                    stopping = stopping or agreed(stop.requested)
                if stopping:
                    raise TrainInterrupted(step, stopping)
    except BaseException:
        if losses:  # what ran is worth keeping, even when the run stops early
            metrics.write()
        raise
    finally:
        traced = window.close() if window is not None else None  # a run that stopped inside the window
        if traced is not None:
            log(traced)
        metrics.close()
    return TrainResult(
        model=program.ir.name,
        mesh=run.mesh,
        data=dataset.description,
        out=options.out,
        start=run.start,
        losses=losses,
        first_step_s=first_step_s,
        steady=metrics.throughput(since_step=run.start),
        unit=dataset.unit,
        checkpoint=newest,
        leader=leader,
        eval_losses=eval_losses,
        eval_accuracies=eval_accuracies,
        utilization=utilization,
    )


def _profile_window(options: TrainOptions, done: int, log: Callable[[str], None]) -> ProfileWindow | None:
    """The steps `--profile` traces, of those this run (which starts after step `done`) runs."""
    if options.profile is None:
        return None
    start, stop = options.profile
    if stop <= done or start > options.steps:
        log(f"--profile {start}:{stop}: no step of it runs here (steps {done + 1}-{options.steps}), nothing traced")
        return None
    return ProfileWindow(max(start, done + 1), min(stop, options.steps), options.out / PROFILE_DIR)


def _utilization(program: Program, device_flops: float | None) -> Utilization:
    """The model FLOPs per step (the planner's forward and backward) and the peak of this
    run's devices (dslc.train.utilization)."""
    counted = plan_flops(program.ir)
    kind = jax.devices()[0].device_kind
    peak = peak_for(kind, program.ir.train.compute_dtype, device_flops)
    return Utilization(counted.forward + counted.backward, program.ir.mesh.devices, peak, kind)


def evaluate(
    program: Program, model: DslcModel, held_out: Dataset, seed: int, rows: np.ndarray | None = None
) -> dict[str, float]:
    """The mean loss over EVAL_BATCHES held-out batches (dropout off) as `eval_loss`; for a
    classifier (`cross_entropy`: an image's label, a language model's next token) the share of
    the positions counted whose largest logit is the target's, `eval_accuracy`; and for a
    mixture of experts its load and dropped tokens on them (`dslc.runtime.metrics`'s figures,
    named `eval_moe_...`)."""
    batches = [held_out.batch(seed, i, rows) for i in range(EVAL_BATCHES)]
    found = {"eval_loss": float(np.mean([float(program.loss(model, b)) for b in batches]))}
    loss = program.ir.loss
    if loss is not None and loss.kind == CrossEntropy.kind:
        found["eval_accuracy"] = _accuracy(program, model, batches, args(loss, CrossEntropy))
    if any(RULES[layer.kind].has_aux for layer in ir.all_layers(program.ir)):
        aux = [program.aux(model, b) for b in batches]
        on_held_out = moe_metrics({k: float(np.mean([a[k] for a in aux])) for k in aux[0]})
        found |= {f"eval_{name}": value for name, value in on_held_out.items()}
    return found


def _accuracy(
    program: Program, model: DslcModel, batches: list[dict[str, np.ndarray]], loss: CrossEntropyArgs
) -> float:
    """The share of the positions the loss counts whose largest logit is the target's class,
    over `batches`; computed on the mesh, so that every process gets the same figure."""
    right = counted = 0.0
    for batch in batches:
        logits = program.forward(model, batch)
        placed = program.place(batch, loss=True)
        targets = placed[loss.targets]
        counts = targets != loss.ignore_index
        if loss.mask is not None:
            counts = counts & (placed[loss.mask] != 0)
        right += float(((jax.numpy.argmax(logits, axis=-1) == targets) & counts).sum())
        counted += float(counts.sum())
    return right / max(counted, 1.0)


def _start_from(program: Program, model: DslcModel, weights: Mapping[str, np.ndarray]) -> None:
    """Replace the fresh weights with the given ones, all checked before any is replaced."""
    try:
        program.import_weights(model, weights)
    except WeightsError as exc:
        raise TrainError(f"--init-from: {exc}") from None


def _stopped_at_once(checkpoints: Checkpoints, kept: int | None) -> str:
    """What a run stopped without saving leaves, after removing its half-written checkpoint."""
    left = checkpoints.discard_unfinished()
    if kept is None:
        said = "stopped without saving; no checkpoint was kept (train again without --resume)"
    else:
        said = (
            f"stopped without saving; the run can resume from its checkpoint at step {kept} in "
            f"{checkpoints.directory} (the same command with --resume)"
        )
    if left:
        said += (
            f"\n{left[0]} is a checkpoint that was still being written (not used to resume); "
            "the next run in this folder removes it"
        )
    return said


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


def _state(program: Program, dataset: Dataset, run: _Run, step: int) -> RunState:
    return run_state(
        run.model,
        run.opt_state,
        step=step,
        seed=run.seed,
        data_position=step,
        data=dataset.description,
        data_fingerprint=dataset.fingerprint,
        spec=program.ir.name,
        mesh=program.ir.mesh.describe(),
    )
