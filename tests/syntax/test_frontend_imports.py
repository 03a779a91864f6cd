"""The front end stays light (checking a spec, or writing it as Python, imports no accelerator
stack), and its packages import in layers: the IR imports no layer rule.

The imports of the front end are counted in a fresh interpreter, since this test process may
have imported jax already.
"""

from __future__ import annotations

import ast as pyast
import json
import subprocess
import sys

from tests.conftest import ROOT

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
from tests.conftest import ROOT
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


def _imports(module: str) -> set[str]:
    """The dslc modules `module` names in its import statements (at any depth of its code)."""
    path = ROOT.joinpath(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    if not source.is_file():  # a namespace package (`dslc.ir`) runs nothing
        return set()
    found: set[str] = set()
    for node in pyast.walk(pyast.parse(source.read_text())):
        if isinstance(node, pyast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, pyast.ImportFrom) and node.module:
            found.add(node.module)
            # `from dslc.ir import nodes` names a module, `from dslc.ir.nodes import Layer` does not.
            found |= {f"{node.module}.{a.name}" for a in node.names if _exists(f"{node.module}.{a.name}")}
    return {m for m in found if m.split(".")[0] == "dslc" and _exists(m)}


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def test_ir_imports_no_layer_rules() -> None:
    # The IR is below the layer rules and elaboration, which brings the two together, is
    # above both: nothing the IR's modules import, directly or through others, is either.
    # Read from the source, since importing any `dslc` module runs the package's own imports.
    todo = [f"dslc.ir.{p.stem}" for p in (ROOT / "dslc" / "ir").glob("*.py")]
    assert todo
    reached: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(_imports(module))
    above = sorted(m for m in reached if m.split(".")[:2] in (["dslc", "layers"], ["dslc", "elaborate"]))
    assert above == []
