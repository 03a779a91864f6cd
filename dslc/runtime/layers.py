"""One function per layer kind, on global (logical) arrays.

Conventions, shared by every kernel (attention's are in `attention.py`) so that a generated module calls them alike:
the input activation is the first argument; weights follow as keyword arguments named as
the layer rule names them (already cast to the compute dtype); then the layer's static
arguments, keyword-only; `dtype` is the compute dtype's name. Sharding is not a kernel's
business: the caller pins inputs and outputs to the shardings the checker gave them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

# ---- matrix products -----------------------------------------------------------------------------


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, dtype: str) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x.astype(dtype), kernel)
    return y if bias is None else y + bias


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, *, dtype: str) -> jax.Array:
    x = x.astype(dtype)
    return jax.nn.silu(jnp.einsum("...i,io->...o", x, gate)) * jnp.einsum("...i,io->...o", x, up)


def embed(ids: jax.Array, table: jax.Array, *, dtype: str) -> jax.Array:
    # A one-hot contraction rather than a gather: with the table split over the vocabulary
    # it is exactly Megatron's masked local lookup followed by one all-reduce.
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=dtype)
    return jnp.einsum("...v,vd->...d", one_hot, table)


def position_embed(x: jax.Array, table: jax.Array) -> jax.Array:
    # Row i of the table for position i, the same for every sequence of the batch.
    return x + table[: x.shape[-2]]


def conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, stride: int, dtype: str) -> jax.Array:
    y = lax.conv_general_dilated(
        x.astype(dtype),
        kernel,
        window_strides=(stride, stride),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y if bias is None else y + bias


# ---- normalisation -------------------------------------------------------------------------------


def layernorm(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *, eps: float, dtype: str) -> jax.Array:
    # Statistics in f32 whatever the compute dtype: bf16 means lose too much.
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    y = ((h - mean) * lax.rsqrt(var + eps)).astype(dtype) * scale
    return y if bias is None else y + bias


def rmsnorm(x: jax.Array, scale: jax.Array, *, eps: float, dtype: str) -> jax.Array:
    h = x.astype(jnp.float32)
    y = h * lax.rsqrt((h * h).mean(-1, keepdims=True) + eps)
    return y.astype(dtype) * scale


# ---- mixture of experts --------------------------------------------------------------------------
#
# GShard-style routing. A routing group is one sequence: one row of the batch, every position of
# it (a [batch, features] input makes each example a group of one token). Groups are routed
# independently, so the result does not depend on the mesh, the microbatches or the gradient
# accumulation slices a batch is cut into. Inside a group every token picks its top_k experts;
# each expert has `slots` places per group, taken first by every token's first choice in token
# order, then by the second choices, and so on; a choice that finds its expert full is dropped
# (it adds nothing; the residual path around the layer carries the token). Dispatch and combine
# are one-hot tensors [groups, tokens, experts, slots].

# The key of the auxiliary value every layer's aux dict may hold that is added to the loss.
AUX_LOSS = "aux_loss"


def add_aux(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two sets of layers' auxiliary values as one: sums key by key."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


# A mixture of experts' output and its auxiliary values.
MoEResult = tuple[jax.Array, dict[str, jax.Array]]


def moe(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int,
    capacity: float,
    aux_weight: float,
    expert_axes: tuple[str, ...],
    token_axes: tuple[str, ...],
    dtype: str,
) -> MoEResult:
    """Top-k routed GELU MLP experts on [batch, ..., dim], with capacity and dropped tokens.

    Returns the output and the layer's auxiliary values (f32 scalars): `aux_loss`, the
    load-balancing loss times `aux_weight`, to be added to the training loss;
    `moe_dropped` and `moe_routed`, the token-to-expert choices that found their expert full
    and all choices made (counts, summed over the batch).

    Each expert has ceil(capacity * tokens * top_k / experts) slots per group (at most
    `tokens`), `capacity` being the capacity factor. Gates are the router's softmax (f32)
    renormalised over the chosen k; a dropped choice keeps its share of the gate, so its
    token's expert output shrinks rather than being reweighted. The load-balancing loss is
    Switch Transformer's, per group and averaged over groups: experts * sum_e(f_e * p_e), f_e
    the share of the group's choices (before dropping) that went to expert e, p_e the mean
    router probability of e; it is 1 when routing is perfectly even.

    `expert_axes` are the mesh axes splitting the experts (w_in[ep, _, _]); `token_axes`
    those splitting the batch. With experts split, the layer runs in `jax.shard_map`, manual
    over both (every other axis stays automatic): where the experts' axes also split the
    batch, each device routes its own sequences and `lax.all_to_all` carries every expert's
    slots to the device that holds it and the results back; where the tokens are whole
    along the experts' axes, every device routes the same tokens, fills only its own
    experts' slots and one `psum` adds the experts' contributions together. Inside another
    `shard_map` (a pipeline stage) its backward pass recomputes its forward first
    (`_shard_map_with_inner_vjp`).
    """
    route = functools.partial(_moe_groups, top_k=top_k, capacity=capacity, aux_weight=aux_weight, dtype=dtype)
    experts = _split_axes(expert_axes)
    if not experts:
        # Every expert on every device: plain arrays; XLA splits the groups over the batch axes.
        return route(x, router, w_in, w_out, exchange="local", expert_axes=(), stats_axes=())
    tokens = _split_axes(token_axes)
    rows = PartitionSpec(tokens or None)
    split_experts = PartitionSpec(experts)
    exchange = "all_to_all" if set(experts) <= set(tokens) else "psum"
    nested = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside the pipeline's shard_map
    shard_map = _shard_map_with_inner_vjp if nested else jax.shard_map
    return shard_map(
        functools.partial(route, exchange=exchange, expert_axes=experts, stats_axes=tokens),
        in_specs=(rows, PartitionSpec(), split_experts, split_experts),
        out_specs=(rows, PartitionSpec()),
        axis_names=frozenset({*tokens, *experts}),
    )(x, router, w_in, w_out)


def _shard_map_with_inner_vjp(
    body: functools.partial[MoEResult],
    *,
    in_specs: tuple[PartitionSpec, ...],
    out_specs: tuple[PartitionSpec, PartitionSpec],
    axis_names: frozenset[str],
) -> jax.custom_vjp[MoEResult]:
    """`jax.shard_map(body, ...)` whose backward pass is a second `shard_map` running
    `jax.vjp(body)` on each device, recomputing the body's forward there.

    Differentiating a `shard_map` directly splits it into a forward that returns its
    residuals and a backward that takes them; nested in another `shard_map` (the pipeline's,
    manual over the stage axis) jax 0.10.2 gives those residuals shapes that disagree with
    their shardings ("'sdy.manual_computation' op result shape, corresponding sharding, and
    region result shape ... must match"), and lowering fails. Saving only the inputs avoids
    that, at the price of the forward computed (and its collectives sent) once more.
    """
    forward = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names)

    def pullback(args: tuple[jax.Array, ...], cotangent: MoEResult) -> tuple[jax.Array, ...]:
        return jax.vjp(body, *args)[1](cotangent)

    backward = jax.shard_map(pullback, in_specs=(in_specs, out_specs), out_specs=in_specs, axis_names=axis_names)

    @jax.custom_vjp
    def run(*args: jax.Array) -> MoEResult:
        return forward(*args)

    run.defvjp(lambda *args: (forward(*args), args), backward)
    return run


def _split_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes among `axes` of more than one device, on the mesh set with `jax.set_mesh`
    (XLA's partitioner rejects a manual axis of one device next to automatic ones), less
    those an enclosing `shard_map` made manual already (data parallelism's: the tokens
    here are this device's rows)."""
    if not axes:
        return ()
    mesh = jax.sharding.get_abstract_mesh()
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"mixture of experts over {missing} needs the mesh: call it under `jax.set_mesh(mesh)`")
    return tuple(a for a in axes if mesh.shape[a] > 1 and a not in mesh.manual_axes)


def _moe_groups(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int,
    capacity: float,
    aux_weight: float,
    dtype: str,
    exchange: str,
    expert_axes: tuple[str, ...],
    stats_axes: tuple[str, ...],
) -> MoEResult:
    """`moe` on the groups at hand (one device's, inside `shard_map`). `exchange` says how
    the slots reach the experts: "local" (all experts are here), "all_to_all" or "psum" over
    `expert_axes`; `stats_axes` are the manual axes the groups are split over."""
    shape = x.shape
    x = x.astype(dtype).reshape(shape[0], -1, shape[-1])  # [groups, tokens, dim]
    dispatch, combine, stats = _route(x, router, top_k=top_k, capacity=capacity)
    if exchange == "psum":
        # The tokens are whole here, and so are the routing tables: keep this device's experts.
        mine = w_in.shape[0]
        first = lax.axis_index(expert_axes) * mine
        dispatch = lax.dynamic_slice_in_dim(dispatch, first, mine, axis=2)
        combine = lax.dynamic_slice_in_dim(combine, first, mine, axis=2)
    slots = jnp.einsum("gsec,gsd->gecd", dispatch.astype(dtype), x)  # [groups, experts, slots, dim]
    if exchange == "all_to_all":
        # Expert e's slots of every group go to the device holding e; the groups of all the
        # devices along the axes arrive stacked, [devices * groups, experts here, slots, dim].
        slots = lax.all_to_all(slots, expert_axes, 1, 0, tiled=True)
    hidden = jax.nn.gelu(jnp.einsum("gecd,edf->gecf", slots, w_in), approximate=True)
    out = jnp.einsum("gecf,efd->gecd", hidden, w_out)
    if exchange == "all_to_all":
        out = lax.all_to_all(out, expert_axes, 0, 1, tiled=True)
    y = jnp.einsum("gsec,gecd->gsd", combine.astype(dtype), out)
    if exchange == "psum":
        y = lax.psum(y, expert_axes)
    if stats_axes:
        # Every device holds as many groups: the mean over groups is the mean of the means.
        # (`moe_routed` is the same on every device: its psum is it times their number.)
        stats = {
            AUX_LOSS: lax.pmean(stats[AUX_LOSS], stats_axes),
            "moe_dropped": lax.psum(stats["moe_dropped"], stats_axes),
            "moe_routed": lax.psum(stats["moe_routed"], stats_axes),
        }
    return y.reshape(shape), {**stats, AUX_LOSS: aux_weight * stats[AUX_LOSS]}


def _route(
    x: jax.Array, router: jax.Array, *, top_k: int, capacity: float
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The routing of groups x [groups, tokens, dim]: the one-hot dispatch tensor and the
    gate-weighted combine tensor [groups, tokens, experts, slots] (f32), and the load-balancing
    loss (unweighted, mean over the groups) with the dropped and routed choice counts."""
    groups, tokens, _ = x.shape
    experts = router.shape[-1]
    slots = min(tokens, math.ceil(capacity * tokens * top_k / experts))
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, router).astype(jnp.float32), axis=-1)
    top, chosen = lax.top_k(probs, top_k)  # [groups, tokens, k]
    gates = top / top.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [groups, tokens, k, experts]
    # Slots are taken choice by choice (all first choices, then all second ones), in token
    # order within each: a running count per expert over that order is each choice's slot.
    order = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * tokens, experts)
    taken = (jnp.cumsum(order, axis=1) - 1) * order
    slot = taken.reshape(groups, top_k, tokens, experts).transpose(0, 2, 1, 3).sum(-1)  # [groups, tokens, k]
    # A slot past the last is a dropped choice: its one-hot row is all zeros.
    in_slot = jax.nn.one_hot(slot, slots, dtype=jnp.float32)  # [groups, tokens, k, slots]
    dispatch = jnp.einsum("gske,gskc->gsec", choice.astype(jnp.float32), in_slot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, choice.astype(jnp.float32), in_slot)
    share = choice.sum((1, 2)).astype(jnp.float32) / (tokens * top_k)  # f_e per group
    balance = experts * jnp.sum(share * probs.mean(1), axis=-1)
    dropped = jnp.sum(slot >= slots).astype(jnp.float32)
    routed = jnp.asarray(groups * tokens * top_k, jnp.float32)
    return dispatch, combine, {AUX_LOSS: balance.mean(), "moe_dropped": dropped, "moe_routed": routed}


# ---- elementwise ---------------------------------------------------------------------------------


def gelu(x: jax.Array, *, approximate: bool) -> jax.Array:
    return jax.nn.gelu(x, approximate=approximate)


def relu(x: jax.Array) -> jax.Array:
    return jax.nn.relu(x)


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(x)


def dropout(x: jax.Array, *, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when there is no key (evaluation)."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ---- losses (f32, mean over the positions counted) -----------------------------------------------


def cross_entropy(
    logits: jax.Array, *, targets: jax.Array, mask: jax.Array | None = None, ignore_index: int, classes: int = 0
) -> jax.Array:
    """The mean over the positions counted (see `cross_entropy_count`); 0 when none is.
    Logits past the first `classes` (when given) are a padded vocabulary's, out of the softmax."""
    logits = logits.astype(jnp.float32)
    if classes:
        # The lowest finite f32 rather than -inf: it adds nothing to the softmax, and the
        # one-hot product below multiplies it by zero without making a NaN.
        real = jnp.arange(logits.shape[-1]) < classes
        logits = jnp.where(real, logits, jnp.finfo(jnp.float32).min)
    # The target logit picked by a one-hot product: over vocab-split logits this is a local
    # partial sum and one all-reduce (Megatron's vocab-parallel cross-entropy). An ignored
    # target outside the vocabulary picks nothing.
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    counted = _counted(targets, mask, ignore_index)
    losses = jnp.where(counted, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)


def cross_entropy_count(
    *, targets: jax.Array, mask: jax.Array | None = None, ignore_index: int, classes: int = 0
) -> jax.Array:
    """How many positions `cross_entropy` averages over: those whose target is not
    `ignore_index` and whose mask, when given, is not zero (f32). `classes` is the loss's own
    argument, which the count does not need."""
    return jnp.sum(_counted(targets, mask, ignore_index)).astype(jnp.float32)


def _counted(targets: jax.Array, mask: jax.Array | None, ignore_index: int) -> jax.Array:
    counted = targets != ignore_index
    return counted if mask is None else counted & (mask != 0)


def mse(x: jax.Array, *, targets: jax.Array) -> jax.Array:
    diff = x.astype(jnp.float32) - targets.astype(jnp.float32)
    return jnp.mean(diff * diff)
