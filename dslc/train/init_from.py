"""The weights a new run starts from (`dslc train --init-from`): a .npz by dotted name, as
`dslc init` and `dslc import` write it, or a Hugging Face checkpoint folder, read as
`dslc import` reads it. Importing no jax, this runs before the run's program is built."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dslc.frontend import Analysis
from dslc.interop import plan_import
from dslc.interop.errors import file_problem
from dslc.ir.weights import mismatches


def initial_weights(source: Path, analysis: Analysis) -> dict[str, np.ndarray]:
    """Every weight by dotted name. A folder that is not a checkpoint the spec can read, or
    weights that do not fit it, raise `dslc.interop.CheckpointError`; a file that is not an
    .npz, OSError or ValueError."""
    if source.is_dir():
        return dict(plan_import(analysis, source).arrays())
    with np.load(source, allow_pickle=False) as data:
        weights = {name: data[name] for name in data.files}
    assert analysis.program is not None
    problems = mismatches(analysis.program, {name: value.shape for name, value in weights.items()})
    if problems:
        raise file_problem(source, "C007", "the weights do not fit the spec", notes=problems)
    return weights
