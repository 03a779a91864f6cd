"""Branches: consecutive `branch { }` statements read the same input and their outputs are
summed (GPT-NeoX's and PaLM's parallel attention and MLP, `x + attn(ln_1(x)) + mlp(ln_2(x))`).

The numbers are checked against numpy written here, which knows nothing of the IR: the sum of
the arms, each computed from the block's input, on one device and with the arms split
Megatron-style over `model` (column- then row-parallel), where each arm's row-parallel partial
sums are reduced before the arms are added. Tolerance 1e-5 relative to the largest entry, f32:
the sharded run sums its partial products in another order (a few f32 ulps, 1.2e-7, of the
output's scale; measured at most 7e-8); feeding an arm the other arm's output instead of the input,
or dropping an arm, moves the output by its whole scale.
"""

from __future__ import annotations

import numpy as np
import pytest

import dslc
from dslc.diagnostics import Diagnostic, Severity
from dslc.ir import nodes as ir
from dslc.plan import plan
from tests.conftest import compiled

HEADER = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 16]\ninput y: f32[8 @ data, 16]\n"

PARALLEL = (
    HEADER
    + """
forward(x) {
  residual {
    branch {
      a: linear(16, 16)
    }
    branch {
      up: linear(16, 32) shard kernel[_, model], bias[model]
      relu()
      down: linear(32, 16) shard kernel[model, _]
    }
  }
  loss: mse(y)
}
"""
)

# GPT-J and PaLM: one norm, read by both branches.
SHARED_NORM = PARALLEL.replace("  residual {\n", "  residual {\n    ln: layernorm(16)\n")


def _numpy_forward(w: dict[str, np.ndarray], x: np.ndarray, norm: bool) -> np.ndarray:
    h = x.astype(np.float64)
    if norm:
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        h = (h - mean) / np.sqrt(var + 1e-5) * w["ln.scale"] + w["ln.bias"]
    first = h @ w["a.kernel"] + w["a.bias"]
    second = np.maximum(h @ w["up.kernel"] + w["up.bias"], 0) @ w["down.kernel"] + w["down.bias"]
    return x + first + second


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x1", "2x2"])
@pytest.mark.parametrize("norm", [False, True], ids=["two-norms", "shared-norm"])
def test_branches_sum_their_arms_each_computed_from_the_input(mesh: str, norm: bool) -> None:
    run = compiled(SHARED_NORM if norm else PARALLEL, mesh=mesh)
    want = _numpy_forward({k: np.asarray(v, np.float64) for k, v in run.weights.items()}, run.batch["x"], norm)
    error = np.abs(run.output - want).max() / np.abs(want).max()
    assert error < 1e-5, error


def test_the_ir_holds_each_arm_apart() -> None:
    analysis = dslc.analyze(SHARED_NORM)
    assert analysis.program is not None
    residual = analysis.program.nodes[0]
    assert isinstance(residual, ir.Residual)
    norm, branches = residual.body
    assert isinstance(norm, ir.Layer) and isinstance(branches, ir.Branches)
    assert [[n.path for n in arm] for arm in branches.arms] == [["a"], ["up", "relu", "down"]]
    assert branches.input == branches.output == norm.output


def test_labelled_branches_name_their_layers() -> None:
    text = PARALLEL.replace("    branch {\n      a:", "    attn_path: branch {\n      a:")
    analysis = dslc.analyze(text)
    assert analysis.program is not None
    names = {w.name for w in ir.stacked_weights(analysis.program.nodes)}
    assert {"attn_path.a.kernel", "up.kernel", "down.kernel"} <= names


def test_the_plan_counts_every_arm() -> None:
    """Both arms' FLOPs, activations and collectives, as the same layers in a row would have:
    the row-parallel `down` reduces over `model` whichever way the layers are arranged."""
    chained = HEADER + (
        "forward(x) {\n  a: linear(16, 16)\n  up: linear(16, 32) shard kernel[_, model], bias[model]\n"
        "  relu()\n  down: linear(32, 16) shard kernel[model, _]\n  loss: mse(y)\n}\n"
    )
    parallel, sequential = (dslc.analyze(text).program for text in (PARALLEL, chained))
    assert parallel is not None and sequential is not None
    got, want = plan(parallel), plan(sequential)
    assert got.flops == want.flops
    assert got.communication == want.communication
    assert any(t.kind == "all-reduce" and t.axes == ("model",) for t in got.communication)


# ---- what the checker says ----------------------------------------------------------------------


def line_of(text: str, written: str, nth: int = 1) -> int:
    """The line (1-based) of the `nth` line of `text` holding `written`."""
    return [i for i, line in enumerate(text.split("\n"), 1) if written in line][nth - 1]


def _errors(text: str) -> list[Diagnostic]:
    return [d for d in dslc.check(text) if d.severity == Severity.ERROR]


def test_a_lone_branch_is_refused() -> None:
    text = HEADER + "forward(x) {\n  residual {\n    branch {\n      a: linear(16, 16)\n    }\n  }\n  loss: mse(y)\n}\n"
    (d,) = _errors(text)
    assert (d.code, d.span.line) == ("E028", line_of(text, "branch {"))
    assert "nothing to be summed" in d.message and d.help is not None


def test_arms_of_different_shapes_are_refused_at_the_second() -> None:
    (d,) = _errors(PARALLEL.replace("down: linear(32, 16)", "down: linear(32, 8)").replace("x + ", ""))
    assert d.code == "E016" and d.span.line == line_of(PARALLEL, "branch {", 2)
    assert "f32[8@data, 8]" in d.message
    assert d.labels and "f32[8@data, 16]" in d.labels[0].message


def test_arms_sharded_differently_are_refused() -> None:
    text = PARALLEL.replace(
        "down: linear(32, 16) shard kernel[model, _]",
        "down: linear(32, 16) shard kernel[model, _]\n      layout [data, model]",
    )
    (d,) = _errors(text)
    assert d.code == "E017" and "sharded alike" in d.message
    assert d.help is not None and "row-parallel" in d.help


def test_a_loss_inside_a_branch_is_refused() -> None:
    text = PARALLEL.replace("      a: linear(16, 16)\n", "      a: linear(16, 16)\n      inner: mse(y)\n")
    (d,) = _errors(text)
    assert (d.code, d.span.line) == ("E028", line_of(text, "inner:"))
    assert d.help is not None and "after the branches" in d.help
