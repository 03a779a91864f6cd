"""Mixture of experts: a router picks top-k experts per token; experts split over an axis.

The arithmetic is `dslc.runtime.layers.moe` (GShard-style dispatch with a capacity per expert);
this rule says how much room the experts have, which layouts the kernel supports, and what
the layer communicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, Axes, Collective, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    F32,
    ArgSpec,
    Context,
    LayerRule,
    WeightSpec,
    expect_features,
    fmt_axes,
    gather_dims,
    operand_numel,
    same_sharding,
)


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """The arguments of one use of `MoE`."""

    dim: int
    hidden: int
    experts: int
    top_k: int
    capacity: float
    aux_weight: float


class MoE(LayerRule[MoEArgs]):
    kind = "moe"
    doc = (
        "Top-k routed GELU MLP experts. Each sequence is a routing group: every expert takes "
        "ceil(capacity * tokens * top_k / experts) of its choices (first choices first); the "
        "others are dropped (the residual path carries their tokens). Gates are renormalised over "
        "the chosen k; aux_weight times the Switch load-balancing loss joins the training loss. "
        "Expert parallel: w_in[ep, _, _], w_out[ep, _, _] (tokens split over ep travel to their "
        "experts by all-to-all and back; tokens whole along ep are routed on every device, and "
        "one all-reduce sums the experts' shares)."
    )
    args = (
        ArgSpec("dim", "int", doc="model width"),
        ArgSpec("hidden", "int", doc="hidden width of each expert"),
        ArgSpec("experts", "int", doc="number of experts"),
        ArgSpec("top_k", "int", 2, "experts per token"),
        ArgSpec("capacity", "float", 1.25, "capacity factor: slots per expert, as a multiple of the even share"),
        ArgSpec("aux_weight", "float", 0.01, "weight of the load-balancing loss", positive=False),
    )
    Args = MoEArgs
    has_aux = True

    def weights(self, a: MoEArgs) -> tuple[WeightSpec, ...]:
        d, f, e = a.dim, a.hidden, a.experts
        return (
            WeightSpec("router", (d, e), "fan_in"),
            WeightSpec("w_in", (e, d, f), "fan_in", fan_in=d),
            WeightSpec("w_out", (e, f, d), "fan_in", fan_in=f),
        )

    def validate(self, a: MoEArgs, ctx: Context) -> bool:
        k, e, c, w = a.top_k, a.experts, a.capacity, a.aux_weight
        if k > e:
            ctx.error(
                "E024",
                f"top_k ({k}) is more than the {e} experts there are",
                at=ctx.arg_span("top_k"),
                labels=[Label(ctx.arg_span("experts"), f"{e} experts")] if "experts" in ctx.arg_spans else [],
                help=f"use top_k <= {e}",
            )
            return False
        if c <= 0:
            ctx.error(
                "E024", f"capacity must be positive, got {c}", at=ctx.arg_span("capacity"), help="1.0 to 2.0 is usual"
            )
            return False
        if w < 0:
            ctx.error(
                "E024",
                f"aux_weight cannot be negative, got {w}",
                at=ctx.arg_span("aux_weight"),
                help="0 turns the load-balancing loss off",
            )
            return False
        return True

    def infer(self, a: MoEArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if not expect_features(ctx, x, a.dim, "features"):
            return None
        if x.sharding[-1]:
            ctx.error(
                "E017",
                f"`{ctx.path}` routes whole tokens, but its input's features are split over {fmt_axes(x.sharding[-1])}",
                labels=[Label(ctx.input_span, "split here")],
            )
            return None
        ep = w["w_in"].sharding[0]
        ok = same_sharding(ctx, "w_out", w["w_out"], 0, ep, "each expert's two matrices live together")
        for dim in (0, 1):
            ok &= same_sharding(ctx, "router", w["router"], dim, (), "every device routes its tokens over all experts")
        if not ok:
            return None
        tokens, experts = split_axes(x.sharding[0], ctx.mesh), split_axes(ep, ctx.mesh)
        if experts and any(axis in tokens for axis in experts) and not set(experts) <= set(tokens):
            ctx.error(
                "E029",
                f"`{ctx.path}` splits its experts over {fmt_axes(experts)}, but its tokens over only "
                f"{fmt_axes(tuple(axis for axis in experts if axis in tokens))} of them",
                at=ctx.weight_span("w_in"),
                labels=[Label(ctx.input_span, f"tokens split over {fmt_axes(x.sharding[0])} here")],
                notes=[
                    "the experts' axes must all split the batch too (tokens travel to their experts by "
                    "all-to-all), or none of them (every device routes the same tokens)"
                ],
                help="split the batch over every expert axis, or over none of them",
            )
            return None
        _check_capacity(a, x, ctx)
        d, e = a.dim, a.experts
        if experts and set(experts) <= set(tokens):
            shape = (x.shape[0], e, capacity_slots(a, group_tokens(x)), d)
            slots = TensorType(ctx.compute_dtype, shape, (x.sharding[0], (), (), ()))
            ctx.collective("all-to-all", experts, slots, f"`{ctx.path}`: send every expert its slots")
            ctx.collective("all-to-all", experts, slots, f"`{ctx.path}`: return the experts' outputs")
        else:
            # Every device holds every token: a sequence split over an expert axis is gathered
            # first (each device routes whole sequences), then the devices sum their experts'
            # contributions.
            operand = gather_dims(ctx, x, experts, x.rank - 1, f"`{ctx.path}`: gather whole sequences")
            ctx.operand = operand.sharding
            ctx.collective(
                "all-reduce",
                experts,
                TensorType(ctx.compute_dtype, x.shape, operand.sharding),
                f"`{ctx.path}`: sum the experts' outputs",
            )
        return TensorType(ctx.compute_dtype, x.shape, x.sharding)

    def flops(self, a: MoEArgs, x: TensorType, y: TensorType) -> int:
        """The router, the one-hot dispatch and combine products and the experts on every slot
        (empty slots included: the kernel computes them)."""
        d, f, e = a.dim, a.hidden, a.experts
        groups, per_group = x.shape[0], group_tokens(x)
        tokens, c = groups * per_group, capacity_slots(a, per_group)
        router = 2 * tokens * d * e
        dispatch_and_combine = 2 * (2 * tokens * e * c * d)  # [tokens, experts, slots] by [tokens, dim], and back
        experts = 2 * (2 * groups * e * c * d * f)  # both matrices, on every slot
        return router + dispatch_and_combine + experts

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The kernel's (dslc.runtime.layers.moe): the operand; the router's probabilities
        (f32); the dispatch and combine tensors [groups, tokens, experts, slots]; and for every
        slot this device computes, its input and output (dim each) and the hidden layer before
        and after the GELU. (XLA recomputes the one-hot choices and the GELU's terms inside the
        backward's fusions rather than keeping them.)"""
        c = DTYPE_BYTES[compute]
        x, probs, slots, computed, width = _moe_sizes(layer, mesh, slices)
        return x * c + probs * F32 + 2 * probs * slots * c + 2 * computed * width * c

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The gradients of the operand and of the slots, their hidden layer included. (Fitted
        against XLA's memory analysis of moe_small's gradient step: planned / measured 1.04 on
        2x4 and 0.94 on 1x1; without checkpointing 1.01 and 0.87.)"""
        x, _, _, computed, width = _moe_sizes(layer, mesh, slices)
        return (x + computed * width) * DTYPE_BYTES[compute]

    def pipeline_recompute_collectives(self, layer: Layer) -> tuple[Collective, ...]:
        # Inside the pipeline's `shard_map` a mixture of experts recomputes its forward,
        # exchange included, before differentiating it (see
        # `dslc.runtime.layers._shard_map_with_inner_vjp`).
        return exchange_collectives(layer)

    def kernel_args(
        self, a: MoEArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {
            "top_k": a.top_k,
            "capacity": a.capacity,
            "aux_weight": a.aux_weight,
            "expert_axes": weights["w_in"][0],
            "token_axes": operand[0],
            "dtype": dtype,
        }


def _moe_sizes(layer: Layer, mesh: Mesh, slices: int) -> tuple[int, int, int, int, int]:
    """On one device: the operand's elements, the tokens x experts of its router
    probabilities, the slots per expert and routing group, the slots it computes, and the
    width of a slot's activations (dim + hidden)."""
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    x = operand_numel(layer, mesh, slices)
    a = MoE().args_of(layer)
    d, f, e = a.dim, a.hidden, a.experts
    per_group = group_tokens(layer.input)
    tokens = x // d
    slots = capacity_slots(a, per_group)
    # Split tokens reach their experts by all-to-all, and a device computes as many slots as
    # its own groups fill; tokens whole along the expert axes fill only its experts' slots.
    axes = expert_axes(layer, mesh)
    exchanged = bool(set(axes) & set(operand.sharding[0]))
    computed = (tokens // per_group) * e * slots // (1 if exchanged else mesh.size(axes))
    return x, tokens * e, slots, computed, d + f


def group_tokens(x: TensorType) -> int:
    """Tokens in one routing group (one sequence) of an input [batch, ..., dim]."""
    return math.prod(x.shape[1:-1])


def capacity_slots(a: MoEArgs, tokens: int) -> int:
    """Slots each expert has in a routing group of `tokens` tokens: the kernel's formula."""
    return min(tokens, math.ceil(a.capacity * tokens * a.top_k / a.experts))


def split_axes(axes: Axes, mesh: Mesh) -> Axes:
    """The axes that split anything: those of more than one device (as the kernel sees them)."""
    return tuple(a for a in axes if mesh.size((a,)) > 1)


def expert_axes(layer: Layer, mesh: Mesh) -> Axes:
    """The mesh axes a checked `moe` layer splits its experts over (none: not expert parallel)."""
    return split_axes(layer.weight("w_in").type.sharding[0], mesh)


def exchange_collectives(layer: Layer) -> tuple[Collective, ...]:
    """The collectives that bring a checked `moe` layer's tokens to its experts and back:
    the two all-to-alls, or the all-reduce of the experts' outputs (none without experts split)."""
    return tuple(c for c in layer.collectives if c.kind in ("all-to-all", "all-reduce"))


def _check_capacity(a: MoEArgs, x: TensorType, ctx: Context) -> None:
    """A capacity "cannot hold" a sequence when its experts' slots together are fewer than the
    sequence's choices: then tokens are dropped at every step, however evenly the router
    spreads them. (A capacity factor of 1 or more always holds.)"""
    k, e, c = a.top_k, a.experts, a.capacity
    tokens = group_tokens(x)
    slots = capacity_slots(a, tokens)
    if e * slots >= tokens * k:
        return
    ctx.error(
        "E024",
        f"capacity {c} cannot hold a sequence: its {e} experts have {e * slots} slots for the "
        f"{tokens * k} choices of its {tokens} tokens (top_k={k})",
        at=ctx.arg_span("capacity"),
        notes=[
            f"each sequence of {x.describe()} is a routing group of {tokens} tokens; each expert takes "
            f"ceil({c} x {tokens} x {k} / {e}) = {slots} of its choices",
            "even perfectly balanced routing would drop tokens at every step",
        ],
        help="use capacity >= 1.0",
    )
