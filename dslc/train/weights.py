"""Weights into and out of training runs.

`initial_weights` gives the weights a new run starts from (`dslc train --init-from`): a .npz
by dotted name, as `dslc init` and `dslc import` write it, or a Hugging Face checkpoint
folder, read as `dslc import` reads it; it imports no jax, so it runs before the run's program
is built. `trained_weights` gives the parameters of a run's newest checkpoint (for
`dslc export --weights RUN`): the f32 master copy where the spec keeps one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dslc.files import read_npz
from dslc.frontend import Analysis
from dslc.interop import plan_import
from dslc.interop.errors import file_problem
from dslc.ir.weights import mismatches

if TYPE_CHECKING:
    from dslc.lower.program import Program


def initial_weights(source: Path, analysis: Analysis) -> dict[str, np.ndarray]:
    """Every weight by dotted name. A folder that is not a checkpoint the spec can read, or
    weights that do not fit it, raise `dslc.interop.CheckpointError`; a file that is not an
    .npz, `dslc.files.UnreadableArrays` (a ValueError) saying what it is instead."""
    if source.is_dir():
        return dict(plan_import(analysis, source).arrays())
    weights = read_npz(source)
    assert analysis.program is not None
    problems = mismatches(analysis.program, {name: value.shape for name, value in weights.items()})
    if problems:
        raise file_problem(source, "C007", "the weights do not fit the spec", notes=problems)
    return weights


def trained_weights(program: Program, run: Path) -> tuple[int, dict[str, np.ndarray]]:
    """The step and the parameters of the newest checkpoint in the run folder `run`, restored
    onto `program`'s mesh. A folder without checkpoints, or with those of another spec, raises
    `dslc.interop.CheckpointError` (C007)."""
    from dslc.train.checkpoint import Checkpoints
    from dslc.train.loop import CHECKPOINTS_DIR

    checkpoints = Checkpoints(run / CHECKPOINTS_DIR)
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise file_problem(
                run, "C007", "holds no checkpoint of a `dslc train` run", help="give a .npz or a run folder"
            )
        saved = checkpoints.run_state(step)
        # A checkpoint holds the arrays as the module stores them (a repeat's layers stacked
        # as `blocks.*.q`), so it is checked against the stored names, not the per-layer ones.
        stored = {name: list(p.shape) for name, p in program.module.PARAMETERS.items()}
        problems = saved.mismatch(replace(saved, weights=stored))
        if problems:
            raise file_problem(run, "C007", f"its checkpoint at step {step} does not fit the spec", notes=problems)
        model = program.init(0)
        opt_state = checkpoints.restore(step, model, program.init_optimizer(model))
        return step, program.export_weights(model, opt_state)
    finally:
        checkpoints.close()
