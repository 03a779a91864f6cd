"""Losses: the end of the forward pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import INT_DTYPES, Input, Layer, Mesh, Sharding, TensorType, replicated
from dslc.layers.base import (
    F32,
    Context,
    LayerRule,
    arg,
)


@dataclass(frozen=True, slots=True)
class CrossEntropyArgs:
    """The arguments of one use of `CrossEntropy`."""

    targets: str = arg("input", doc="the declared input holding the class ids")
    ignore_index: int = arg("int", -100, "a target that is not counted", positive=False)
    mask: str | None = arg("input", None, "a declared input shaped like the targets: 0 (false) where not counted")
    classes: int = arg("int", 0, "the real classes, the rest of the logits padding; 0: all", positive=False)


class CrossEntropy(LayerRule[CrossEntropyArgs]):
    kind = "cross_entropy"
    doc = (
        "Softmax cross-entropy of logits [..., classes] against integer targets [...], averaged over the "
        "positions counted: those whose target is not `ignore_index` (Hugging Face's -100) and, given a "
        "`mask` input, whose mask is not zero. Vocab-parallel logits allowed. Logits past the first `classes` "
        "are padding, masked out of the softmax: the compiler sets it where it pads a vocabulary."
    )
    Args = CrossEntropyArgs
    is_loss = True
    count_kernel = "cross_entropy_count"
    masks_padding = True

    def validate(self, a: CrossEntropyArgs, ctx: Context) -> bool:
        if a.classes < 0:
            ctx.error("E024", f"`classes` of `cross_entropy` is a count, got {a.classes}", at=ctx.arg_span("classes"))
            return False
        return True

    def infer(self, a: CrossEntropyArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        target = ctx.inputs[a.targets]
        t = target.type
        if t.dtype not in INT_DTYPES:
            ctx.error(
                "E016", f"targets `{target.name}` must hold integer class ids, but are {t.describe()}", at=target.span
            )
            return None
        if x.rank < 1 or t.shape != x.shape[:-1]:
            ctx.error(
                "E016",
                f"`{ctx.path}` needs targets shaped like the logits without their last dimension: "
                f"logits {x.describe()}, targets {t.describe()}",
                labels=[Label(ctx.input_span, "logits produced here"), Label(target.span, "targets declared here")],
            )
            return None
        if t.sharding != x.sharding[:-1]:
            ctx.error(
                "E017",
                f"targets `{target.name}` are sharded {t.describe()} but the logits are {x.describe()}",
                labels=[Label(target.span, "targets declared here"), Label(ctx.input_span, "logits produced here")],
                help="shard the targets' dimensions like the logits' leading dimensions",
            )
            return None
        if a.mask is not None and not _mask_fits(ctx.inputs[a.mask], target, ctx):
            return None
        classes = a.classes
        if classes > x.shape[-1]:
            ctx.error(
                "E016",
                f"`{ctx.path}` counts {classes} classes, but its logits have {x.shape[-1]}: {x.describe()}",
                at=ctx.arg_span("classes"),
                labels=[Label(ctx.input_span, "logits produced here")],
                help=f"at most {x.shape[-1]}, or leave `classes` out to count them all",
            )
            return None
        scalar = replicated("f32", ())
        ctx.collective(
            "all-reduce",
            x.sharding[-1],
            TensorType("f32", x.shape[:-1], x.sharding[:-1]),
            f"`{ctx.path}`: vocab-parallel softmax statistics",
        )
        return scalar

    def flops(self, a: CrossEntropyArgs, x: TensorType, y: TensorType) -> int:
        return 6 * x.numel

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 2 * layer.input.slice_numel(mesh, slices) * F32  # the f32 one-hot targets and exp(logits)

    def kernel_args(
        self, a: CrossEntropyArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        # Only padded logits need the mask: others are left as they were.
        static: dict[str, object] = {"ignore_index": a.ignore_index}
        return static | ({"classes": a.classes} if a.classes else {})


def _mask_fits(mask: Input, target: Input, ctx: Context) -> bool:
    """A loss's mask must be laid out like its targets."""
    m, t = mask.type, target.type
    if m.shape != t.shape:
        ctx.error(
            "E016",
            f"mask `{mask.name}` must be shaped like the targets: mask {m.describe()}, targets {t.describe()}",
            at=ctx.arg_span("mask"),
            labels=[Label(mask.span, "mask declared here"), Label(target.span, "targets declared here")],
        )
        return False
    if m.sharding != t.sharding:
        ctx.error(
            "E017",
            f"mask `{mask.name}` is sharded {m.describe()} but the targets are {t.describe()}",
            at=ctx.arg_span("mask"),
            labels=[Label(mask.span, "mask declared here"), Label(target.span, "targets declared here")],
            help="shard the mask like the targets",
        )
        return False
    return True


@dataclass(frozen=True, slots=True)
class MeanSquaredErrorArgs:
    """The arguments of one use of `MeanSquaredError`."""

    targets: str = arg("input", doc="the declared input holding the targets")


class MeanSquaredError(LayerRule[MeanSquaredErrorArgs]):
    kind = "mse"
    doc = "Mean squared error of the activation against a float target input of the same shape."
    Args = MeanSquaredErrorArgs
    is_loss = True

    def infer(
        self, a: MeanSquaredErrorArgs, x: TensorType, w: dict[str, TensorType], ctx: Context
    ) -> TensorType | None:
        target = ctx.inputs[a.targets]
        t = target.type
        if t.shape != x.shape:
            ctx.error(
                "E016",
                f"`{ctx.path}` compares tensors of one shape, "
                f"but the activation is {x.describe()} and the targets are {t.describe()}",
                labels=[Label(ctx.input_span, "activation produced here"), Label(target.span, "targets declared here")],
            )
            return None
        if t.sharding != x.sharding:
            ctx.error(
                "E017",
                f"targets `{target.name}` are sharded {t.describe()} but the activation is {x.describe()}",
                labels=[Label(target.span, "targets declared here"), Label(ctx.input_span, "activation produced here")],
            )
            return None
        return replicated("f32", ())

    def flops(self, a: MeanSquaredErrorArgs, x: TensorType, y: TensorType) -> int:
        return 3 * x.numel

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.input.slice_numel(mesh, slices) * F32  # the f32 difference
