"""2-D convolution on [batch, height, width, channels] (NHWC), 'same' padding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    Context,
    LayerRule,
    WeightSpec,
    arg,
    bias_add_flops,
    contract,
    expect_features,
    same_sharding,
)


@dataclass(frozen=True, slots=True)
class ConvArgs:
    """The arguments of one use of `Conv`."""

    in_: int = arg("int", doc="input channels")
    out: int = arg("int", doc="output channels")
    kernel: int = arg("int", 3, "window height and width")
    stride: int = arg("int", 1, "step between windows")
    bias: bool = arg("bool", True, "add a bias")


class Conv(LayerRule[ConvArgs]):
    kind = "conv"
    doc = "2-D convolution, NHWC, 'same' padding. Split output channels: kernel[_, _, _, tp]."
    Args = ConvArgs

    def weights(self, a: ConvArgs) -> tuple[WeightSpec, ...]:
        k = a.kernel
        kernel = WeightSpec("kernel", (k, k, a.in_, a.out), "fan_in")
        return (kernel, WeightSpec("bias", (a.out,), "zeros")) if a.bias else (kernel,)

    def infer(self, a: ConvArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 4:
            ctx.error(
                "E016",
                f"`{ctx.path}` expects [batch, height, width, channels], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a.in_, "input channels"):
            return None
        kernel = w["kernel"]
        for d in (0, 1):
            if not same_sharding(ctx, "kernel", kernel, d, (), "the window is applied whole"):
                return None
        for d in (1, 2):
            if x.sharding[d]:
                ctx.error(
                    "E029",
                    f"`{ctx.path}` cannot convolve an image split along its spatial dimensions",
                    labels=[Label(ctx.input_span, f"split here: {x.describe()}")],
                    help="split the batch or the channels instead",
                )
                return None
        as_matrix = TensorType(kernel.dtype, (a.in_, a.out), kernel.sharding[2:])
        y = contract(ctx, x, as_matrix, "kernel", ctx.compute_dtype)
        if y is None:
            return None
        stride = a.stride
        h, wd = (-(-x.shape[1] // stride), -(-x.shape[2] // stride))
        if "bias" in w:
            same_sharding(ctx, "bias", w["bias"], 0, kernel.sharding[3], "it is added to the output channels")
        return TensorType(y.dtype, (x.shape[0], h, wd, y.shape[3]), y.sharding)

    def flops(self, a: ConvArgs, x: TensorType, y: TensorType) -> int:
        k = a.kernel
        return 2 * y.numel * k * k * x.shape[3] + bias_add_flops(y.numel // a.out, a.out if a.bias else 0)

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the operand, for the kernel's gradient

    def kernel_args(
        self, a: ConvArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"stride": a.stride, "dtype": dtype}
