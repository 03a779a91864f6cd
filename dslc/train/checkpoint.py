"""Training checkpoints with orbax: parameters, optimizer state and where the run stands.

Each checkpoint is one orbax step directory holding two items: `state` (the parameters by
dotted name and the optimizer state, saved per shard) and `run` (a JSON `RunState`: step,
seed, data position and what the spec looked like). Orbax writes a step into a temporary
directory and renames it into place only when every item is complete, so a process killed
mid-save leaves the previous checkpoints as they were and the half-written one is never
listed (and is removed the next time the folder is opened). A save stopped by a second
Ctrl-C is removed at once, once the writes it started have ended (`discard_unfinished`).

Saves are asynchronous unless asked otherwise: `save` returns once the arrays are copied
to host memory (so the next step may donate and overwrite them), and the files are written
and committed in the background while training goes on. A save waits for the one before
it, and `close` for the last.

Restoring reads the arrays straight into the shardings of the program being resumed, so a
run saved on one mesh continues on another.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from dslc.lower.program import DslcModel

# The last few, so a checkpoint that turns out bad (a diverged run) is not the only one.
KEEP = 3
# Test hook: "STEP:MARKER" makes the save of checkpoint STEP stop half-way, after orbax has
# started writing the step's temporary directory and before it commits it, and write the
# temporary directory's path to the file MARKER; the save then waits until MARKER is
# removed, or the process killed (or interrupted).
PAUSE_ENV = "DSLC_TRAIN_PAUSE_IN_SAVE"
# How long an interrupted save's writes may take to end before its temporary directory is
# removed; past it the directory is left to orbax's clean-up when the folder is next opened.
WRITES_END_S = 10.0


@dataclass(frozen=True)
class RunState:
    """Everything besides the arrays that a resumed run needs, and what it checks."""

    step: int  # optimizer steps done
    seed: int
    data_position: int  # batches consumed; the next batch is `data_position`
    data: str  # the data set's description
    data_fingerprint: str
    spec: str  # the spec's model name
    mesh: str
    weights: dict[str, list[int]]  # dotted name -> shape
    optimizer_state: str  # the optimizer state's tree structure

    def mismatch(self, other: RunState) -> list[str]:
        """How the spec that wrote `self` differs from the one described by `other`."""
        problems = []
        if self.spec != other.spec:
            problems.append(f"it is of model `{self.spec}`, this spec is `{other.spec}`")
        missing = sorted(set(other.weights) - set(self.weights))
        unknown = sorted(set(self.weights) - set(other.weights))
        reshaped = [
            f"`{n}` is {tuple(s)} there, {tuple(other.weights[n])} here"
            for n, s in sorted(self.weights.items())
            if n in other.weights and s != other.weights[n]
        ]
        if missing:
            problems.append(f"it lacks {len(missing)} weights of this spec (`{missing[0]}`, ...)")
        if unknown:
            problems.append(f"it has {len(unknown)} weights this spec does not (`{unknown[0]}`, ...)")
        problems.extend(reshaped[:3])
        if not problems and self.optimizer_state != other.optimizer_state:
            problems.append("its optimizer state has another structure (was the spec's optimizer changed?)")
        return problems


def run_state(model: DslcModel, opt_state: Any, **fields: Any) -> RunState:
    """The RunState of a model and optimizer state; `fields` gives the rest."""
    weights = {name: list(value.shape) for name, value in model.arrays().items()}
    return RunState(weights=weights, optimizer_state=str(jax.tree.structure(opt_state)), **fields)


class Checkpoints:
    """The checkpoints of one run folder (`directory`), newest `KEEP` kept."""

    def __init__(self, directory: Path, asynchronous: bool = True) -> None:
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.LatestN(KEEP),
            cleanup_tmp_directories=True,
            # Metrics written after an asynchronous save may run ahead of the newest
            # committed checkpoint; a resumed run drops the rows past the step it resumes.
            enable_async_checkpointing=asynchronous,
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.StandardSave)
        registry.add("state", ocp.args.StandardRestore)
        run_handler = _PausingJsonHandler() if os.environ.get(PAUSE_ENV) else ocp.JsonCheckpointHandler()
        registry.add("run", ocp.args.JsonSave, run_handler)
        registry.add("run", ocp.args.JsonRestore, run_handler)
        self._manager = ocp.CheckpointManager(directory.absolute(), options=options, handler_registry=registry)
        self._closed = False
        # The threads an interrupted save left behind: orbax's writers, which may still be
        # writing into its temporary directory.
        self._writers: list[threading.Thread] = []

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def committed_step(self) -> int | None:
        """The newest checkpoint on disk, listed afresh (and after `close` too): a save that
        was interrupted may or may not have committed its step before it stopped. A step's
        directory takes its bare number only when orbax commits it."""
        try:
            steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir()]
        except OSError:
            return None
        return max(steps, default=None)

    def save(self, model: DslcModel, opt_state: Any, state: RunState) -> None:
        before = set(threading.enumerate())
        try:
            self._manager.save(
                state.step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": model.arrays(), "optimizer": opt_state}),
                    run=ocp.args.JsonSave(dataclasses.asdict(state)),
                ),
            )
        except BaseException:  # Ctrl-C above all, which stops orbax wherever it is
            self._writers = [t for t in threading.enumerate() if t not in before]
            raise

    def unfinished(self) -> list[Path]:
        """The temporary directories of saves that never committed."""
        try:
            return sorted(p for p in self.directory.iterdir() if ocp.path.step.TMP_DIR_SUFFIX in p.name)
        except OSError:
            return []

    def discard_unfinished(self) -> list[Path]:
        """Remove the temporary directories of saves that never committed, and return those
        still there. An interrupted save's writes are waited for first (up to WRITES_END_S):
        removing a directory while they go on would see them recreate parts of it; one
        whose writes do not end in time is left (and listed).

        Only after `close`: orbax's own clean-up of earlier unfinished saves, started when
        the folder was opened, is over by then."""
        assert self._closed, "discard_unfinished runs after close"
        deadline = time.monotonic() + WRITES_END_S
        try:
            for thread in self._writers:
                thread.join(max(deadline - time.monotonic(), 0.0))
        except KeyboardInterrupt:  # yet another Ctrl-C: stop waiting, leave the directory
            return self.unfinished()
        if any(thread.is_alive() for thread in self._writers):
            return self.unfinished()
        for path in self.unfinished():
            shutil.rmtree(path, ignore_errors=True)  # another process of the run may remove it too
        return self.unfinished()

    def run_state(self, step: int) -> RunState:
        self._manager.wait_until_finished()  # a save still writing in the background
        restored = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))
        return RunState(**restored.run)

    def restore(self, step: int, model: DslcModel, opt_state: Any) -> Any:
        """Load checkpoint `step` into `model` and return its optimizer state, each array
        placed with the sharding it has in `model` and `opt_state` (which may be on another
        mesh than the one that saved it)."""
        self._manager.wait_until_finished()
        target = {"params": model.arrays(), "optimizer": opt_state}
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), target)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        for name, value in restored.state["params"].items():
            model.params[name].set_value(value)
        return restored.state["optimizer"]

    def close(self) -> None:
        if self._closed:
            return
        # The manager starts removing unfinished saves in a thread when it opens, and only a
        # save waits for that thread; a process that ends before it finishes (a refused
        # `--resume`) would get a traceback from it at interpreter shutdown.
        self._manager._maybe_await_cleanup_tmp_directory()
        self._manager.close()
        self._closed = True


class _PausingJsonHandler(ocp.JsonCheckpointHandler):
    """The `run` item's handler under the PAUSE_ENV test hook (see there)."""

    async def async_save(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        futures = await super().async_save(directory, item, args)
        step, marker = os.environ[PAUSE_ENV].split(":", 1)
        if args is not None and args.item["step"] == int(step):
            Path(marker).write_text(str(directory))
            while Path(marker).exists():  # until the test removes the marker or kills the process
                time.sleep(0.05)
        return futures
