"""How close a computation must come to its reference, and how closeness is measured, for
every numerics test: the tolerances and the measurements behind them are in the docstring of
tests/lower/test_numerics.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dslc.lower.program import Program


@dataclass(frozen=True)
class Tolerance:
    forward: float
    loss: float
    grads: float


F32 = Tolerance(forward=3e-5, loss=3e-5, grads=3e-5)
BF16 = Tolerance(forward=4e-2, loss=5e-4, grads=1e-1)


def tolerance(program: Program) -> Tolerance:
    return BF16 if program.ir.train.compute_dtype == "bf16" else F32


def relative_error(got: Any, want: Any) -> float:
    """max|got - want| / max|want| (the plain max difference where `want` is all zeros)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(np.max(np.abs(want), initial=0.0))
    diff = float(np.max(np.abs(got - want), initial=0.0))
    return diff / scale if scale > 0 else diff


# Gradients that vanish in exact arithmetic, so both sides hold only rounding noise: a key bias
# without rotary embeddings adds the same q . bias to every score of a query's row, which the
# softmax takes away. They are measured against the scale of all the gradients instead. By the
# end of the weight's name: every layer's (`h.3.attn.k_bias`).
VANISHING = ("attn.k_bias",)


def vanishes(name: str) -> bool:
    return any(name == v or name.endswith("." + v) for v in VANISHING)


def grads_error(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> dict[str, float]:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    scale = max(float(np.max(np.abs(g))) for g in want.values())
    return {
        name: relative_error(got[name], want[name])
        if not vanishes(name)
        else float(np.max(np.abs(np.asarray(got[name], np.float64) - want[name]))) / scale
        for name in want
    }


def assert_grads_close(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tol: float) -> None:
    errors = grads_error(got, want)
    worst = sorted(errors, key=errors.__getitem__, reverse=True)[:5]
    assert errors[worst[0]] <= tol, "worst gradients: " + ", ".join(f"{n} {errors[n]:.2e}" for n in worst)
