"""Layers that act on each element alone: activations and dropout. They keep the sharding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, FLOAT_DTYPES, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    A,
    Context,
    LayerRule,
    arg,
)


@dataclass(frozen=True, slots=True)
class NoArgs:
    """The arguments of a kind that takes none."""


@dataclass(frozen=True, slots=True)
class GeluArgs:
    """The arguments of one use of `Gelu`."""

    approximate: bool = arg("bool", True, "tanh approximation; false: exact, with erf")


@dataclass(frozen=True, slots=True)
class DropoutArgs:
    """The arguments of one use of `Dropout`."""

    rate: float = arg("float", doc="fraction dropped, in [0, 1)", positive=False)


class Elementwise(LayerRule[A]):
    cost = 1
    # What is kept is the input, in the compute dtype: the kernels' own backward passes
    # (dslc.runtime.layers) recompute an activation's derivative from it.

    def infer(self, a: A, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.dtype not in FLOAT_DTYPES:
            ctx.error(
                "E016",
                f"`{ctx.path}` needs floating-point input, but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        return x

    def flops(self, a: A, x: TensorType, y: TensorType) -> int:
        return self.cost * x.numel

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return self.kept_per_element(compute) * layer.input.slice_numel(mesh, slices)

    def kept_per_element(self, compute: str) -> int:
        return DTYPE_BYTES[compute]

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the input's gradient


class Relu(Elementwise[NoArgs]):
    kind = "relu"
    doc = "max(x, 0)."
    Args = NoArgs


class Gelu(Elementwise[GeluArgs]):
    kind = "gelu"
    doc = (
        "Gaussian error linear unit: x * Phi(x), Phi the standard normal CDF, by default in the tanh "
        "approximation (GPT-2's gelu_new); approximate=false computes the exact erf form (BERT, Pythia)."
    )
    Args = GeluArgs
    cost = 8

    def kernel_args(
        self, a: GeluArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"approximate": a.approximate}


@dataclass(frozen=True, slots=True)
class SoftcapArgs:
    """The arguments of one use of `Softcap`."""

    cap: float = arg("float", doc="the bound, for example 30.0")


class Softcap(Elementwise[SoftcapArgs]):
    kind = "softcap"
    doc = "cap * tanh(x / cap): values squashed smoothly into (-cap, cap), as Gemma 2 caps its logits."
    Args = SoftcapArgs
    cost = 4

    def kernel_args(
        self, a: SoftcapArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"cap": a.cap}


class Silu(Elementwise[NoArgs]):
    kind = "silu"
    doc = "x * sigmoid(x)."
    Args = NoArgs
    cost = 4


class Dropout(Elementwise[DropoutArgs]):
    kind = "dropout"
    doc = "Zeroes a fraction `rate` of activations while training; the identity otherwise."
    Args = DropoutArgs
    random = True

    def kept_per_element(self, compute: str) -> int:
        return 1  # the mask, one byte an element, whatever the dtype

    def draws(self, layer: Layer) -> bool:
        return self.args_of(layer).rate > 0.0

    def validate(self, a: DropoutArgs, ctx: Context) -> bool:
        rate = a.rate
        if not 0.0 <= rate < 1.0:
            ctx.error(
                "E024",
                f"dropout rate must be in [0, 1), got {rate}",
                at=ctx.arg_span("rate"),
                help="for example dropout(0.1)",
            )
            return False
        return True

    def kernel_args(
        self, a: DropoutArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"rate": a.rate}
