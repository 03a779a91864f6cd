"""The front end stays light: checking a spec, or writing it as Python, imports no accelerator stack.

Run in a fresh interpreter, since this test process may have imported jax already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("jax", "jaxlib", "flax", "optax", "numpy")

_PROBE = """
import json, sys
import dslc
from dslc.cli import main
from dslc.syntax.format import format_module
diags = dslc.check(sys.argv[1])
analysis = dslc.analyze(sys.argv[1], mesh="2x4x2")
format_module(analysis.module, analysis.source.text)
from dslc.codegen import generate_module
generate_module(sys.argv[1])
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:]))
print(json.dumps({"diagnostics": len(diags), "ok": analysis.ok, "heavy": heavy}))
"""


def test_check_imports_no_accelerator_stack() -> None:
    spec = ROOT / "specs" / "gpt_small.par"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(spec), *HEAVY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result == {"diagnostics": 0, "ok": True, "heavy": []}
