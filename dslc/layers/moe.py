"""Mixture of experts: a router picks top-k experts per token; experts split over an axis.

The arithmetic is `dslc.runtime.experts.moe` (a capacity per expert with one-hot dispatch, or
dropless with sorted rows and grouped products; shared experts beside them); this rule says
how much room the experts have, which layouts the kernel supports, and what the layer
communicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, Axes, Collective, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    F32,
    Context,
    LayerRule,
    WeightSpec,
    arg,
    expect_features,
    fmt_axes,
    gather_dims,
    operand_numel,
    same_sharding,
)

ACTIVATIONS = ("gelu", "relu", "silu", "swiglu", "geglu")  # dslc.runtime.experts.ACTIVATIONS
GATED = ("swiglu", "geglu")


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """The arguments of one use of `MoE`."""

    dim: int = arg("int", doc="model width")
    hidden: int = arg("int", doc="hidden width of each expert")
    experts: int = arg("int", doc="number of experts")
    top_k: int = arg("int", 2, "experts per token")
    capacity: float | None = arg(
        "float",
        1.25,
        "capacity factor: slots per expert, as a multiple of the even share; none: dropless",
        nullable=True,
    )
    aux_weight: float = arg("float", 0.01, "weight of the load-balancing loss", positive=False)
    z_weight: float = arg("float", 0.0, "weight of the router z-loss (ST-MoE; 1e-3 is usual)", positive=False)
    normalize: bool = arg("bool", True, "renormalise the gates over the chosen k")
    activation: str = arg("choice", "gelu", "the experts' activation", choices=ACTIVATIONS)
    shared: int = arg("int", 0, "hidden width of the shared experts every token passes; 0: none", positive=False)
    shared_router: bool = arg("bool", False, "scale the shared experts by sigmoid(x @ s_router) (Qwen2-MoE)")
    balance: float = arg(
        "float",
        0.0,
        "auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the choosing scores, moved by this "
        "much each step against its expert's excess load (1e-3 is usual); 0: none",
        positive=False,
    )

    @property
    def gated(self) -> bool:
        return self.activation in GATED


class MoE(LayerRule[MoEArgs]):
    kind = "moe"
    doc = (
        "Top-k routed MLP experts, and optionally shared experts every token passes. Each sequence "
        "is a routing group. With a capacity factor every expert takes ceil(capacity * tokens * "
        "top_k / experts) of a group's choices (first choices first) and drops the others (the "
        "residual path carries their tokens); with capacity=none nothing is dropped: the choices "
        "are sorted by expert and each expert multiplies exactly its rows. Gates are the router's "
        "softmax, renormalised over the chosen k unless normalize=false; aux_weight times the "
        "Switch load-balancing loss and z_weight times the router z-loss join the training loss. "
        "Expert parallel: w_in[ep, _, _], w_out[ep, _, _] (tokens split over ep reach their "
        "experts by all-to-all, or dropless by an all-gather and a reduce-scatter; tokens whole "
        "along ep are routed on every device and one all-reduce sums the experts' shares). "
        "Tensor parallel inside the experts: w_in[ep, _, tp], w_out[ep, tp, _]."
    )
    Args = MoEArgs
    has_aux = True

    def weights(self, a: MoEArgs) -> tuple[WeightSpec, ...]:
        d, f, e, s = a.dim, a.hidden, a.experts, a.shared
        routed = [
            WeightSpec("router", (d, e), "fan_in"),
            WeightSpec("w_in", (e, d, f), "fan_in", fan_in=d),
            WeightSpec("w_out", (e, f, d), "fan_in", fan_in=f),
        ]
        if a.gated:
            routed.append(WeightSpec("w_gate", (e, d, f), "fan_in", fan_in=d))
        if s:
            routed += [WeightSpec("s_in", (d, s), "fan_in"), WeightSpec("s_out", (s, d), "fan_in")]
            if a.gated:
                routed.append(WeightSpec("s_gate", (d, s), "fan_in"))
            if a.shared_router:
                routed.append(WeightSpec("s_router", (d, 1), "fan_in"))
        if a.balance:
            routed.append(WeightSpec("balance_bias", (e,), "zeros"))
        return tuple(routed)

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
        if c is not None and c <= 0:
            ctx.error(
                "E024",
                f"capacity must be positive, got {c}",
                at=ctx.arg_span("capacity"),
                help="1.0 to 2.0 is usual; capacity=none drops nothing",
            )
            return False
        weights = (("aux_weight", w, "the load-balancing loss"), ("z_weight", a.z_weight, "the z-loss"))
        for name, value, off in (*weights, ("balance", a.balance, "the balancing bias")):
            if value < 0:
                ctx.error(
                    "E024", f"{name} cannot be negative, got {value}", at=ctx.arg_span(name), help=f"0 turns {off} off"
                )
                return False
        if a.shared_router and not a.shared:
            ctx.error(
                "E024",
                "shared_router=true scales the shared experts, but there are none",
                at=ctx.arg_span("shared_router"),
                help="give their hidden width, `shared=...`",
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
        ep, tp = w["w_in"].sharding[0], w["w_in"].sharding[2]
        why = "each expert's matrices live together"
        ok = same_sharding(ctx, "w_out", w["w_out"], 0, ep, why)
        ok &= same_sharding(ctx, "w_in", w["w_in"], 1, (), "every device holds whole tokens")
        ok &= same_sharding(ctx, "w_out", w["w_out"], 1, tp, "it contracts w_in's output")
        ok &= same_sharding(ctx, "w_out", w["w_out"], 2, (), "the experts' outputs are whole tokens")
        if "w_gate" in w:
            for dim in (0, 1, 2):
                ok &= same_sharding(
                    ctx, "w_gate", w["w_gate"], dim, w["w_in"].sharding[dim], "it is multiplied with w_in's output"
                )
        for dim in (0, 1):
            ok &= same_sharding(ctx, "router", w["router"], dim, (), "every device routes its tokens over all experts")
        if "balance_bias" in w:
            ok &= same_sharding(ctx, "balance_bias", w["balance_bias"], 0, (), "every device chooses among all experts")
        shared_tp = w["s_in"].sharding[1] if "s_in" in w else ()
        if "s_in" in w:
            ok &= same_sharding(ctx, "s_in", w["s_in"], 0, (), "every device holds whole tokens")
            ok &= same_sharding(ctx, "s_out", w["s_out"], 0, shared_tp, "it contracts s_in's output")
            ok &= same_sharding(ctx, "s_out", w["s_out"], 1, (), "the shared experts' outputs are whole tokens")
            if "s_gate" in w:
                for dim in (0, 1):
                    ok &= same_sharding(
                        ctx, "s_gate", w["s_gate"], dim, w["s_in"].sharding[dim], "it is multiplied with s_in's output"
                    )
            if "s_router" in w:
                for dim in (0, 1):
                    ok &= same_sharding(ctx, "s_router", w["s_router"], dim, (), "every device gates its own tokens")
        if not ok:
            return None
        tokens, experts = split_axes(x.sharding[0], ctx.mesh), split_axes(ep, ctx.mesh)
        for name, axes in (("w_in", tp), ("s_in", shared_tp)):
            clash = tuple(axis for axis in axes if axis in set(ep) | set(x.sharding[0]))
            if clash:
                ctx.error(
                    "E029",
                    f"`{ctx.path}` splits its hidden width over {fmt_axes(clash)}, which already split its "
                    "experts or its tokens",
                    at=ctx.weight_span(name),
                    help="split the hidden width over an axis of its own (a tensor-parallel one)",
                )
                return None
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
        if a.capacity is not None:
            _check_capacity(a, x, ctx)
        d, e = a.dim, a.experts
        out = TensorType(ctx.compute_dtype, x.shape, x.sharding)
        if experts and set(experts) <= set(tokens) and a.capacity is not None:
            shape = (x.shape[0], e, capacity_slots(a, group_tokens(x)), d)
            slots = TensorType(ctx.compute_dtype, shape, (x.sharding[0], (), (), ()))
            ctx.collective("all-to-all", experts, slots, f"`{ctx.path}`: send every expert its slots")
            ctx.collective("all-to-all", experts, slots, f"`{ctx.path}`: return the experts' outputs")
        elif experts and set(experts) <= set(tokens):
            ctx.collective("all-gather", experts, out, f"`{ctx.path}`: gather the tokens of the experts' devices")
            ctx.collective("reduce-scatter", experts, out, f"`{ctx.path}`: return each device its tokens' sums")
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
        # A hidden width split over a tensor-parallel axis leaves partial sums (row parallel).
        ctx.collective("all-reduce", tp, out, f"`{ctx.path}`: sum the experts' hidden shares")
        if shared_tp:
            ctx.collective("all-reduce", shared_tp, out, f"`{ctx.path}`: sum the shared experts' hidden shares")
        return out

    def flops(self, a: MoEArgs, x: TensorType, y: TensorType) -> int:
        """The router; with a capacity, the one-hot dispatch and combine products and the
        experts on every slot (empty slots included: the kernel computes them); dropless,
        the experts on each token's k rows; the shared experts on every token."""
        d, f, e = a.dim, a.hidden, a.experts
        groups, per_group = x.shape[0], group_tokens(x)
        tokens = groups * per_group
        matrices = 3 if a.gated else 2
        router = 2 * tokens * d * e
        shared = 2 * tokens * d * a.shared * matrices
        if a.capacity is None:
            return router + 2 * tokens * a.top_k * d * f * matrices + shared
        c = capacity_slots(a, per_group)
        dispatch_and_combine = 2 * (2 * tokens * e * c * d)  # [tokens, experts, slots] by [tokens, dim], and back
        experts = 2 * groups * e * c * d * f * matrices  # every matrix, on every slot
        return router + dispatch_and_combine + experts + shared

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The kernel's (dslc.runtime.experts.moe): the operand; the router's probabilities
        (f32); with a capacity, the dispatch and combine tensors [groups, tokens, experts,
        slots]; for every row an expert computes (a slot; dropless, a choice, its buffer
        sized for the worst case under expert parallelism and padded to whole tiles as the CPU
        form computes them), its input and output (dim each) and its hidden layer before the
        activation (both halves of a gated one), which the activation's own backward pass
        keeps (dslc.runtime.layers); dropless, the choices' rows in token order and sorted,
        and each tile's copy of its expert's matrices; the shared experts' hidden layer
        likewise. (XLA recomputes the one-hot choices and the activation's output inside the
        backward's fusions rather than keeping them.)"""
        c = DTYPE_BYTES[compute]
        s = _moe_sizes(layer, mesh, slices)
        dispatch = 2 * s.probs * s.slots * c
        rows = s.rows * (2 * s.row_width - s.hidden) + s.sorted_rows + s.tile_weights
        return s.x * c + s.probs * F32 + dispatch + rows * c + 2 * s.shared * c

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The gradients of the operand and of the rows, their hidden layer included. (Fitted
        against XLA's memory analysis of moe_small's gradient step: planned / measured 1.04 on
        2x4 and 0.94 on 1x1; without checkpointing 1.01 and 0.87.)"""
        s = _moe_sizes(layer, mesh, slices)
        return (s.x + s.rows * s.row_width + s.shared) * DTYPE_BYTES[compute]

    def pipeline_recompute_collectives(self, layer: Layer) -> tuple[Collective, ...]:
        # Inside the pipeline's `shard_map` a mixture of experts recomputes its forward,
        # exchange included, before differentiating it (see
        # `dslc.runtime.experts._shard_map_with_inner_vjp`).
        return exchange_collectives(layer)

    def kernel_args(
        self, a: MoEArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {
            "top_k": a.top_k,
            "capacity": a.capacity,
            "aux_weight": a.aux_weight,
            "z_weight": a.z_weight,
            "normalize": a.normalize,
            "activation": a.activation,
            "expert_axes": weights["w_in"][0],
            "token_axes": operand[0],
            "dtype": dtype,
        }


@dataclass(frozen=True, slots=True)
class Sizes:
    """A `moe` layer's elements on one device for one slice of the batch."""

    x: int  # the operand
    probs: int  # the router's probabilities: tokens routed here x experts
    slots: int  # per expert and routing group (0: dropless)
    rows: int  # the rows its experts compute: slots, or dropless the choices' buffer
    row_width: int  # a row's activations: dim, and the hidden width per matrix it feeds
    hidden: int  # of that, the hidden width (both halves of a gated activation)
    shared: int  # the shared experts' hidden activations
    # Dropless only: the choices in token order and sorted by expert ([choices, dim] each),
    # and the tiles' copies of their experts' matrices, which the backward's products read.
    sorted_rows: int = 0
    tile_weights: int = 0


def _moe_sizes(layer: Layer, mesh: Mesh, slices: int) -> Sizes:
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    x = operand_numel(layer, mesh, slices)
    a = MoE().args_of(layer)
    d, f, e = a.dim, a.hidden, a.experts
    per_group = group_tokens(layer.input)
    tokens = x // d
    axes = expert_axes(layer, mesh)
    exchanged = bool(set(axes) & set(operand.sharding[0]))
    hidden = f * (2 if a.gated else 1) // mesh.size(split_axes(layer.weight("w_in").type.sharding[2], mesh))
    shared = 0
    if a.shared:
        shared = (
            tokens
            * a.shared
            * (2 if a.gated else 1)
            // mesh.size(split_axes(layer.weight("s_in").type.sharding[1], mesh))
        )
    if a.capacity is None:
        routed = routed_tokens(layer, mesh, tokens)
        held = e // mesh.size(axes)
        rows = tiled_rows(routed * a.top_k, held)
        tiles = rows // tile_size(routed * a.top_k, held)
        weights = tiles * d * hidden * (3 if a.gated else 2) // (2 if a.gated else 1)
        return Sizes(x, routed * e, 0, rows, d + hidden, hidden, shared, 2 * routed * a.top_k * d, weights)
    slots = capacity_slots(a, per_group)
    # Split tokens reach their experts by all-to-all, and a device computes as many slots as
    # its own groups fill; tokens whole along the expert axes fill only its experts' slots.
    computed = (tokens // per_group) * e * slots // (1 if exchanged else mesh.size(axes))
    return Sizes(x, tokens * e, slots, computed, d + hidden, hidden, shared)


def routed_tokens(layer: Layer, mesh: Mesh, tokens: int) -> int:
    """The tokens a device routes for `tokens` of its own: dropless, with the tokens split over
    the experts' axes, those of every device along them (gathered; its rows buffer then holds
    all their choices, the worst case being every one for its experts)."""
    operand = layer.operand or layer.input.sharding
    axes = expert_axes(layer, mesh)
    gathered = MoE().args_of(layer).capacity is None and bool(set(axes) & set(operand[0]))
    return tokens * (mesh.size(axes) if gathered else 1)


def tiled_rows(rows: int, experts: int) -> int:
    """The rows a dropless layer's experts compute for `rows` choices over `experts` held
    experts: the buffer of `dslc.runtime.experts.Tiles`, each expert's rows padded to whole
    tiles (the CPU form; XLA's ragged dot on GPU and TPU computes the rows alone, and the
    plan's figure is then the larger by at most a tile per expert)."""
    size = tile_size(rows, experts)
    return (-(-rows // size) + experts) * size


def tile_size(rows: int, experts: int) -> int:
    """The rows of one tile (`dslc.runtime.experts.Tiles`): the power of two nearest below the
    mean rows per expert, within [8, 128]."""
    return min(128, max(8, 1 << max(0, (rows // experts).bit_length() - 1)))


def group_tokens(x: TensorType) -> int:
    """Tokens in one routing group (one sequence) of an input [batch, ..., dim]."""
    return math.prod(x.shape[1:-1])


def capacity_slots(a: MoEArgs, tokens: int) -> int:
    """Slots each expert has in a routing group of `tokens` tokens: the kernel's formula
    (0 for a dropless layer, which has none)."""
    if a.capacity is None:
        return 0
    return min(tokens, math.ceil(a.capacity * tokens * a.top_k / a.experts))


def split_axes(axes: Axes, mesh: Mesh) -> Axes:
    """The axes that split anything: those of more than one device (as the kernel sees them)."""
    return tuple(a for a in axes if mesh.size((a,)) > 1)


def expert_axes(layer: Layer, mesh: Mesh) -> Axes:
    """The mesh axes a checked `moe` layer splits its experts over (none: not expert parallel)."""
    return split_axes(layer.weight("w_in").type.sharding[0], mesh)


def exchange_collectives(layer: Layer) -> tuple[Collective, ...]:
    """The collectives that bring a checked `moe` layer's tokens to its experts and back:
    the two all-to-alls, the all-gather and reduce-scatter (dropless), or the all-reduce of
    the experts' outputs (none without experts split; a tensor-parallel all-reduce is not
    one of them)."""
    ep = set(layer.weight("w_in").type.sharding[0])
    ours = [c for c in layer.collectives if set(c.axes) <= ep]
    kinds = {"all-to-all", "all-reduce", "reduce-scatter"}
    if any(c.kind == "reduce-scatter" for c in ours):
        kinds.add("all-gather")  # dropless: the tokens gathered, not a sequence made whole
    return tuple(c for c in ours if c.kind in kinds)


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
