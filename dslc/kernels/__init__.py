"""The arithmetic both backends run: plain jax functions, one per layer kind, and the pipeline.

Nothing here imports dslc: the direct backend calls these functions, and the code generator
copies their source into the standalone modules it writes, so the two backends compute with
the very same code. A kernel module may import only what a generated module can
(`dslc.codegen.source.PRELUDE_IMPORTS`); a test holds every kernel module to that.
"""

from __future__ import annotations

from pathlib import Path

# The kernel modules in the order the generated code lists them, by the file holding each.
# (Read as text by the code generator, which does not import jax.)
SOURCES = {name: Path(__file__).with_name(f"{name}.py") for name in ("params", "layers", "pipeline", "training")}
