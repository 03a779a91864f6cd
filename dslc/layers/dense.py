"""Layers built on a weight matrix: linear, swiglu, and the token and position embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, FLOAT_DTYPES, INT_DTYPES, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    F32,
    Context,
    LayerRule,
    Vocabulary,
    WeightSpec,
    arg,
    bias_add_flops,
    contract,
    expect_features,
    gather_dims,
    same_sharding,
)


@dataclass(frozen=True, slots=True)
class LinearArgs:
    """The arguments of one use of `Linear`."""

    in_: int = arg("int", doc="input features")
    out: int = arg("int", doc="output features")
    bias: bool = arg("bool", True, "add a bias")


class Linear(LayerRule[LinearArgs]):
    kind = "linear"
    doc = "y = x @ kernel + bias over the last dimension. Column parallel: kernel[_, tp]; row parallel: kernel[tp, _]."
    Args = LinearArgs

    def weights(self, a: LinearArgs) -> tuple[WeightSpec, ...]:
        kernel = WeightSpec("kernel", (a.in_, a.out), "fan_in")
        return (kernel, WeightSpec("bias", (a.out,), "zeros")) if a.bias else (kernel,)

    def vocabulary(self, a: LinearArgs, feeds_masking_loss: bool) -> Vocabulary | None:
        # A head: its outputs are the loss's classes.
        return Vocabulary(a.out, (("kernel", 1), ("bias", 0)), logits=True) if feeds_masking_loss else None

    def infer(self, a: LinearArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if not expect_features(ctx, x, a.in_, "input features"):
            return None
        y = contract(ctx, x, w["kernel"], "kernel", ctx.compute_dtype)
        if y is not None and "bias" in w:
            same_sharding(ctx, "bias", w["bias"], 0, w["kernel"].sharding[1], "it is added to the kernel's output")
        return y

    def flops(self, a: LinearArgs, x: TensorType, y: TensorType) -> int:
        return 2 * y.numel * a.in_ + bias_add_flops(y.numel // a.out, a.out if a.bias else 0)

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the operand, for the kernel's gradient

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The operand's gradient as the product writes it, in f32, and as it is returned.
        x = layer.input.slice_numel(mesh, slices)
        return x * DTYPE_BYTES[compute] + (x * F32 if DTYPE_BYTES[compute] < F32 else 0)

    def kernel_args(
        self, a: LinearArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"dtype": dtype}


@dataclass(frozen=True, slots=True)
class SwiGLUArgs:
    """The arguments of one use of `SwiGLU`."""

    in_: int = arg("int", doc="input features")
    hidden: int = arg("int", doc="hidden features")
    activation: str = arg("choice", "silu", "the gate's activation", choices=("silu", "gelu"))


class SwiGLU(LayerRule[SwiGLUArgs]):
    kind = "swiglu"
    doc = (
        "silu(x @ gate) * (x @ up): the gated half of a Llama MLP (activation=gelu: GeGLU, with the tanh "
        "GeLU, as Gemma's). Shard gate and up alike."
    )
    Args = SwiGLUArgs

    def weights(self, a: SwiGLUArgs) -> tuple[WeightSpec, ...]:
        shape = (a.in_, a.hidden)
        return (WeightSpec("gate", shape, "fan_in"), WeightSpec("up", shape, "fan_in"))

    def infer(self, a: SwiGLUArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if not expect_features(ctx, x, a.in_, "input features"):
            return None
        for d in (0, 1):
            if not same_sharding(
                ctx, "up", w["up"], d, w["gate"].sharding[d], "gate and up are multiplied elementwise"
            ):
                return None
        return contract(ctx, x, w["gate"], "gate", ctx.compute_dtype)

    def flops(self, a: SwiGLUArgs, x: TensorType, y: TensorType) -> int:
        return 4 * y.numel * a.in_ + 4 * y.numel

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The operand, and the two hidden-sized products (dslc.runtime.layers.gated keeps them
        # and recomputes silu(gate) and its derivative).
        x, y = layer.input.slice_numel(mesh, slices), layer.output.slice_numel(mesh, slices)
        return (x + 2 * y) * DTYPE_BYTES[compute]

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The products' gradients, and the operand's: a partial product of its size from each
        # of the two matrices (f32, as a matrix product writes it before the sum).
        x, y = layer.input.slice_numel(mesh, slices), layer.output.slice_numel(mesh, slices)
        return 2 * y * DTYPE_BYTES[compute] + 2 * x * F32

    def kernel_args(
        self, a: SwiGLUArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"dtype": dtype, "activation": a.activation}


@dataclass(frozen=True, slots=True)
class EmbedArgs:
    """The arguments of one use of `Embed`."""

    vocab: int = arg("int", doc="vocabulary size")
    dim: int = arg("int", doc="vector size")
    scale: bool = arg("bool", False, "multiply the vectors by sqrt(dim), in the compute dtype (Gemma)")


class Embed(LayerRule[EmbedArgs]):
    kind = "embed"
    doc = "Token ids to vectors. Vocab parallel: table[tp, _] (masked lookup, then all-reduce)."
    Args = EmbedArgs

    def weights(self, a: EmbedArgs) -> tuple[WeightSpec, ...]:
        return (WeightSpec("table", (a.vocab, a.dim), "normal"),)

    def vocabulary(self, a: EmbedArgs, feeds_masking_loss: bool) -> Vocabulary | None:
        return Vocabulary(a.vocab, (("table", 0),))

    def infer(self, a: EmbedArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.dtype not in INT_DTYPES:
            ctx.error(
                "E016",
                f"`{ctx.path}` looks up integer token ids, but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
                help="declare the input with an integer dtype such as i32",
            )
            return None
        table = w["table"]
        x = gather_dims(ctx, x, table.sharding[0] + table.sharding[1], x.rank, f"`{ctx.path}`: gather token ids")
        ctx.operand = x.sharding
        y = TensorType(ctx.compute_dtype, (*x.shape, a.dim), (*x.sharding, table.sharding[1]))
        ctx.collective("all-reduce", table.sharding[0], y, f"`{ctx.path}`: combine vocab-parallel lookups")
        return y

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # The one-hot matrix [tokens, vocab on this device]: the lookup is a contraction.
        table = layer.weight("table").type
        vocab = table.local_shape(mesh)[0]  # padded, as stored
        return layer.input.slice_numel(mesh, slices) * vocab * DTYPE_BYTES[compute]

    def kernel_args(
        self, a: EmbedArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"dtype": dtype, "scale": a.scale}


@dataclass(frozen=True, slots=True)
class PositionEmbedArgs:
    """The arguments of one use of `PositionEmbed`."""

    positions: int = arg("int", doc="positions the table holds (the longest sequence)")
    dim: int = arg("int", doc="vector size")


class PositionEmbed(LayerRule[PositionEmbedArgs]):
    kind = "position_embed"
    doc = (
        "Learned position embeddings: adds row i of table to the vector at position i of [..., seq, dim] "
        "(GPT-2's wpe). The table holds `positions` rows, seq of which are used; it is whole along "
        "positions and its features split like the input's."
    )
    Args = PositionEmbedArgs

    def weights(self, a: PositionEmbedArgs) -> tuple[WeightSpec, ...]:
        return (WeightSpec("table", (a.positions, a.dim), "normal"),)

    def infer(self, a: PositionEmbedArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.dtype not in FLOAT_DTYPES or x.rank < 2:
            ctx.error(
                "E016",
                f"`{ctx.path}` adds position vectors to [..., seq, dim], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a.dim, "features"):
            return None
        positions, seq = a.positions, x.shape[-2]
        if seq > positions:
            ctx.error(
                "E016",
                f"`{ctx.path}` holds {positions} positions, but its input has {seq}: {x.describe()}",
                at=ctx.arg_span("positions"),
                labels=[Label(ctx.input_span, "input produced here")],
                help=f"make the table at least {seq} positions long, or the sequence at most {positions}",
            )
            return None
        table = w["table"]
        if not same_sharding(ctx, "table", table, 0, (), "the first `seq` rows are read, whatever the split"):
            return None
        if not same_sharding(ctx, "table", table, 1, x.sharding[-1], "it is added to the input's features"):
            return None
        return x

    def flops(self, a: PositionEmbedArgs, x: TensorType, y: TensorType) -> int:
        return x.numel  # one add per element, as a bias's (`LayerRule.flops`)

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0  # an addition keeps nothing for its backward pass

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * DTYPE_BYTES[compute]  # the output's gradient
