"""The runtime library: what a generated module runs and does not depend on the spec —
storage and initialisation, one function per layer kind (and attention's cores), the
pipeline executor, the optimizer and the data-parallel step — as plain, typed functions.

A generated module imports it as `dslc_runtime` (`from dslc_runtime.layers import embed`):
`dslc compile` writes a copy of this folder under that name beside the module, so that the
pair runs with jax, flax, optax and numpy alone, and `Program`, which runs the module inside
dslc, gives it this package under that name (`as_dslc_runtime`). So the modules here import
one another relatively and nothing of dslc; a test holds them to the libraries a generated
module may use (`dslc.codegen.source.PRELUDE_IMPORTS`).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# The runtime's modules, by the file holding each. (The code generator reads them as text, to
# know where each name is defined, without importing jax.)
SOURCES = {
    name: Path(__file__).with_name(f"{name}.py")
    for name in (
        "storage",
        "params",
        "inputs",
        "model",
        "layers",
        "fused",
        "attention",
        "experts",
        "schedule",
        "pipeline",
        "training",
        "metrics",
        "mesh",
    )
}

# The name generated modules import the runtime by.
NAME = "dslc_runtime"


def as_dslc_runtime() -> None:
    """Make this package importable as `dslc_runtime`, the name generated modules use, with
    its modules the very ones `dslc.runtime` holds (one copy of each class and function)."""
    if NAME in sys.modules:
        return
    sys.modules[NAME] = sys.modules[__name__]
    for module in SOURCES:
        sys.modules[f"{NAME}.{module}"] = importlib.import_module(f"{__name__}.{module}")
