"""What turns an image into a sequence and a sequence into one vector: the pieces of a vision
transformer around its blocks (ViT: a strided `conv` cuts the image into patch vectors,
`flatten` reads them as a sequence, `class_token` prepends a learned vector, and `pool` takes
one vector per image for the head)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, FLOAT_DTYPES, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    Context,
    LayerRule,
    WeightSpec,
    arg,
    expect_features,
    same_sharding,
)
from dslc.layers.elementwise import NoArgs


def _refuse_split(ctx: Context, x: TensorType, dims: tuple[int, ...], what: str) -> bool:
    """Report (E029) and return False where one of `dims` of `x` is split: the layer moves
    elements along it, which a split would need collectives to do."""
    split = [d for d in dims if x.sharding[d]]
    if split:
        ctx.error(
            "E029",
            f"`{ctx.path}` {what}, so it cannot take them split: {x.describe()}",
            labels=[Label(ctx.input_span, "split here")],
            help="split the batch or the features instead",
        )
    return not split


class Flatten(LayerRule[NoArgs]):
    kind = "flatten"
    doc = (
        "[batch, height, width, dim] -> [batch, height * width, dim]: a grid of vectors (an image's patches, "
        "as a strided conv makes them) read row by row as a sequence, as ViT's patch embedding flattens them."
    )
    Args = NoArgs

    def infer(self, a: NoArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 4:
            ctx.error(
                "E016",
                f"`{ctx.path}` reads a grid [batch, height, width, dim] as a sequence, but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not _refuse_split(ctx, x, (1, 2), "joins the grid's rows and columns into one sequence"):
            return None
        b, h, wd, d = x.shape
        return TensorType(x.dtype, (b, h * wd, d), (x.sharding[0], (), x.sharding[3]))

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0  # a reshape keeps nothing

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class ClassTokenArgs:
    """The arguments of one use of `ClassToken`."""

    dim: int = arg("int", doc="vector size")


class ClassToken(LayerRule[ClassTokenArgs]):
    kind = "class_token"
    doc = (
        "Prepends a learned vector to each sequence: [batch, seq, dim] -> [batch, seq + 1, dim] (ViT's [CLS] "
        "token, which `pool(mode=first)` reads after the blocks). Its features split like the input's."
    )
    Args = ClassTokenArgs

    def weights(self, a: ClassTokenArgs) -> tuple[WeightSpec, ...]:
        return (WeightSpec("token", (a.dim,), "normal"),)

    def infer(self, a: ClassTokenArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 3 or x.dtype not in FLOAT_DTYPES:
            ctx.error(
                "E016",
                f"`{ctx.path}` prepends a vector to [batch, seq, dim], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a.dim, "features"):
            return None
        if not _refuse_split(ctx, x, (1,), "lengthens the sequence by one"):
            return None
        if not same_sharding(ctx, "token", w["token"], 0, x.sharding[2], "it joins the input's features"):
            return None
        b, s, d = x.shape
        return TensorType(x.dtype, (b, s + 1, d), x.sharding)

    def flops(self, a: ClassTokenArgs, x: TensorType, y: TensorType) -> int:
        return 0  # a copy

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0  # a concatenation keeps nothing for its backward pass

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.output.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the output's gradient

    def kernel_args(
        self, a: ClassTokenArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"dtype": dtype}


@dataclass(frozen=True, slots=True)
class PoolArgs:
    """The arguments of one use of `Pool`."""

    mode: str = arg("choice", "mean", "mean: average the sequence; first: its first vector", choices=("mean", "first"))


class Pool(LayerRule[PoolArgs]):
    kind = "pool"
    doc = (
        "One vector per sequence: [batch, seq, dim] -> [batch, dim], the mean over the sequence (mode=mean) or "
        "its first vector (mode=first: the class token's)."
    )
    Args = PoolArgs

    def infer(self, a: PoolArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 3 or x.dtype not in FLOAT_DTYPES:
            ctx.error(
                "E016",
                f"`{ctx.path}` pools [batch, seq, dim] into [batch, dim], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not _refuse_split(ctx, x, (1,), "reduces the sequence to one vector"):
            return None
        b, _, d = x.shape
        return TensorType(x.dtype, (b, d), (x.sharding[0], x.sharding[2]))

    def flops(self, a: PoolArgs, x: TensorType, y: TensorType) -> int:
        return x.numel if a.mode == "mean" else 0  # one add per element

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0  # a sum or a slice keeps nothing for its backward pass

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the input's gradient

    def kernel_args(
        self, a: PoolArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"mode": a.mode}
