"""Normalisations over the last dimension, which must be whole on every device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, FLOAT_DTYPES, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    F32,
    Context,
    LayerRule,
    WeightSpec,
    arg,
    bias_add_flops,
    expect_features,
    fmt_axes,
    same_sharding,
)


@dataclass(frozen=True, slots=True)
class LayerNormArgs:
    """The arguments of one use of `LayerNorm`."""

    dim: int = arg("int", doc="features")
    eps: float = arg("float", 1e-5, "added to the variance")
    bias: bool = arg("bool", True, "learn a bias")


@dataclass(frozen=True, slots=True)
class RmsNormArgs:
    """The arguments of one use of `RmsNorm`."""

    dim: int = arg("int", doc="features")
    eps: float = arg("float", 1e-6, "added to the mean square")
    offset: bool = arg("bool", False, "the scale is 1 + the stored weight, which starts at 0 (Gemma's norms)")


# The arguments of either norm, which share what they compute from them.
N = TypeVar("N", LayerNormArgs, RmsNormArgs)


class _Norm(LayerRule[N]):
    def infer(self, a: N, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.dtype not in FLOAT_DTYPES:
            ctx.error(
                "E016",
                f"`{ctx.path}` needs floating-point input, but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a.dim, "features"):
            return None
        if x.sharding[-1]:
            ctx.error(
                "E017",
                f"`{ctx.path}` normalises over features that are split over {fmt_axes(x.sharding[-1])}",
                labels=[Label(ctx.input_span, f"features split here: {x.describe()}")],
                help="normalise after a row-parallel layer (whose output is whole), or gather with `layout`",
            )
            return None
        for name, t in w.items():
            same_sharding(ctx, name, t, 0, (), "a norm's parameters are replicated")
        return x

    def flops(self, a: N, x: TensorType, y: TensorType) -> int:
        # Normalising and scaling: an estimate of 8 per element for either norm. A layernorm's
        # bias is then added as every rule adds a bias (`LayerRule.flops`).
        biased = isinstance(a, LayerNormArgs) and a.bias
        return 8 * x.numel + bias_add_flops(x.numel // a.dim, a.dim if biased else 0)

    statistics = 1  # f32 values kept per row: 1 / rms (a layernorm's mean besides)

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The kernel's own backward pass (dslc.runtime.layers._norm) keeps the input as given
        # and the per-row statistics, and recomputes the normalised value.
        x = layer.input.slice_numel(mesh, slices)
        rows = x // layer.input.shape[-1]
        return x * DTYPE_BYTES[compute] + self.statistics * rows * F32

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The backward pass works in f32 (the output's gradient, widened) beside the input's
        # gradient; the normalised value it recomputes fuses into the sums that read it.
        return layer.input.slice_numel(mesh, slices) * (F32 + DTYPE_BYTES[compute])


class LayerNorm(_Norm[LayerNormArgs]):
    kind = "layernorm"
    doc = "(x - mean) / std * scale + bias over the last dimension."
    statistics = 2  # the mean and 1 / standard deviation
    Args = LayerNormArgs

    def weights(self, a: LayerNormArgs) -> tuple[WeightSpec, ...]:
        scale = WeightSpec("scale", (a.dim,), "ones")
        return (scale, WeightSpec("bias", (a.dim,), "zeros")) if a.bias else (scale,)

    def kernel_args(
        self, a: LayerNormArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"eps": a.eps, "dtype": dtype}


class RmsNorm(_Norm[RmsNormArgs]):
    kind = "rmsnorm"
    doc = "x / rms(x) * scale over the last dimension."
    Args = RmsNormArgs

    def weights(self, a: RmsNormArgs) -> tuple[WeightSpec, ...]:
        return (WeightSpec("scale", (a.dim,), "zeros" if a.offset else "ones"),)

    def kernel_args(
        self, a: RmsNormArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"eps": a.eps, "dtype": dtype, "offset": a.offset}
