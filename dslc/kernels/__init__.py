"""What a generated module runs: storage, initialisation, one function per layer kind, the pipeline
executor and the optimizer, as plain functions.

The code generator copies their source into the module it writes for a spec, which is what
runs. A kernel module imports only what a generated module can
(`dslc.codegen.source.PRELUDE_IMPORTS`) and other kernel modules (their definitions land in
the same generated module); a test holds every kernel module to that.
"""

from __future__ import annotations

from pathlib import Path

# The kernel modules in the order the generated code lists them, by the file holding each.
# (Read as text by the code generator, which does not import jax.)
SOURCES = {
    name: Path(__file__).with_name(f"{name}.py")
    for name in ("storage", "params", "layers", "schedule", "pipeline", "training", "metrics")
}
