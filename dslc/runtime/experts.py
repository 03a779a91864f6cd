"""Mixture of experts: routing, the experts' two forms (capacity slots and dropless groups),
shared experts, and the auxiliary values a layer reports.

A routing group is one sequence: one row of the batch, every position of it (a [batch,
features] input makes each example a group of one token). Groups are routed independently,
so the result does not depend on the mesh, the microbatches or the gradient accumulation
slices a batch is cut into. Every token picks its top_k experts by the router's softmax
(f32); its gates are those probabilities, renormalised over the k chosen unless told not to.

Two ways to bring tokens to their experts:

* **capacity** (GShard, Switch): each expert has `slots` places per group, taken first by
  every token's first choice in token order, then by the second choices, and so on; a
  choice that finds its expert full is dropped (it adds nothing; the residual path around
  the layer carries the token). Dispatch and combine are one-hot tensors [groups, tokens,
  experts, slots]; the experts run on their slots, empty ones included.
* **dropless** (Megablocks, Mixtral, DeepSeek): the choices are sorted by expert and every
  expert multiplies exactly its rows, a grouped matrix product (`grouped_experts`): XLA's
  ragged dot on GPU and TPU, equal-sized tiles of one expert each on CPU.

Conventions as in `layers.py`: global arrays in, the caller pins the shardings.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from .layers import gated, gelu, relu, silu

# The key of the auxiliary value every layer's aux dict may hold that is added to the loss.
AUX_LOSS = "aux_loss"

# The experts' activations; the gated ones multiply act(x @ w_gate) by x @ w_in.
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")


def add_aux(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two sets of layers' auxiliary values as one: sums key by key."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


# A mixture of experts' output and its auxiliary values.
MoEResult = tuple[jax.Array, dict[str, jax.Array]]


class Routing(NamedTuple):
    """How one `moe` layer routes (its static arguments)."""

    top_k: int
    capacity: float | None  # None: dropless
    aux_weight: float
    z_weight: float
    normalize: bool
    activation: str
    dtype: str


def moe(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    w_gate: jax.Array | None = None,
    s_in: jax.Array | None = None,
    s_out: jax.Array | None = None,
    s_gate: jax.Array | None = None,
    s_router: jax.Array | None = None,
    balance_bias: jax.Array | None = None,
    *,
    top_k: int,
    capacity: float | None,
    aux_weight: float,
    z_weight: float = 0.0,
    normalize: bool = True,
    activation: str = "gelu",
    expert_axes: tuple[str, ...],
    token_axes: tuple[str, ...],
    dtype: str,
) -> MoEResult:
    """Top-k routed MLP experts on [batch, ..., dim], plus shared experts every token passes.

    Returns the output and the layer's auxiliary values (f32 scalars, summed over layers by
    `add_aux`): `aux_loss`, added to the training loss: `aux_weight` times Switch
    Transformer's load-balancing loss (per group: experts * sum_e(f_e * p_e), f_e the share
    of the group's choices that went to e, p_e its mean router probability; 1 when routing
    is even; the mean over groups) plus `z_weight` times the router z-loss (ST-MoE: the mean
    square of the router logits' log-sum-exp); `moe_z_loss`, that second term alone;
    `moe_dropped` and `moe_routed`, the choices that found no place and all choices made
    (counts over the batch; none dropped without a capacity, counted from the rows the
    experts computed); `moe_load_max`, the busiest expert's choices over the mean (1 when
    even), and `moe_layers` (1), so that their sum over layers divided by the layers' count
    is the mean.

    With a `capacity` factor, each expert has ceil(capacity * tokens * top_k / experts)
    slots per group (at most `tokens`); a dropped choice keeps its share of the gate, so its
    token's output shrinks rather than being reweighted. With `capacity=None` nothing is
    dropped.

    `expert_axes` are the mesh axes splitting the experts (w_in[ep, _, _]); `token_axes`
    those splitting the batch. With experts split, the routed part runs in `jax.shard_map`,
    manual over both (every other axis, a tensor-parallel one splitting the experts' hidden
    width included, stays automatic). Where the experts' axes also split the batch, the
    capacity form sends every expert its slots by `lax.all_to_all` and the results back; the
    dropless form gathers the tokens of the devices along the experts' axes, computes its
    own experts' rows of all of them and scatters the sums back (`psum_scatter`): its rows
    buffer is sized for the worst case, every choice landing on this device's experts.
    Where the tokens are whole along the experts' axes, every device routes the same tokens,
    computes only its own experts' part and one `psum` adds the parts. Inside another
    `shard_map` (a pipeline stage) its backward pass recomputes its forward first
    (`_shard_map_with_inner_vjp`).

    The shared experts (`s_in`, `s_out`, `s_gate` for a gated activation; one MLP of their
    summed width) run on every token outside the routing, their output scaled by
    sigmoid(x @ s_router) where that weight is given (Qwen2-MoE), and added.

    With `balance_bias` [experts] (DeepSeek-V3's auxiliary-loss-free balancing), experts are
    chosen by the router's probabilities plus the bias, and weighted by the probabilities
    alone; the bias gets no gradient from the loss: its "gradient" is each expert's share of
    the choices less the even share (mean over the batch), for an update that moves it
    against the sign of that (`dslc.runtime.training.make_optimizer`).
    """
    routing = Routing(top_k, capacity, aux_weight, z_weight, normalize, activation, dtype)
    experts = {"w_in": w_in, "w_out": w_out} | ({"w_gate": w_gate} if w_gate is not None else {})
    routers = {"router": router} | ({"balance_bias": balance_bias} if balance_bias is not None else {})
    y, aux = _routed(x, routers, experts, routing, expert_axes, token_axes)
    if s_in is not None and s_out is not None:
        y = y + shared_experts(x, s_in, s_out, s_gate, s_router, activation=activation, dtype=dtype)
    return y, aux


def shared_experts(
    x: jax.Array,
    s_in: jax.Array,
    s_out: jax.Array,
    s_gate: jax.Array | None,
    s_router: jax.Array | None,
    *,
    activation: str,
    dtype: str,
) -> jax.Array:
    """The always-on experts: one MLP on every token, optionally scaled by a sigmoid gate."""
    x = x.astype(dtype)
    up = jnp.einsum("...d,df->...f", x, s_in)
    gate = jnp.einsum("...d,df->...f", x, s_gate) if s_gate is not None else None
    y = jnp.einsum("...f,fd->...d", expert_activation(up, gate, activation), s_out)
    if s_router is not None:
        y = y * jax.nn.sigmoid(jnp.einsum("...d,do->...o", x, s_router))
    return y


def expert_activation(up: jax.Array, gate: jax.Array | None, activation: str) -> jax.Array:
    """An expert's hidden layer from x @ w_in (`up`) and, for a gated activation, x @ w_gate."""
    match activation:
        case "gelu":
            return gelu(up, approximate=True)
        case "relu":
            return relu(up)
        case "silu":
            return silu(up)
        case "swiglu" if gate is not None:
            return gated(gate, up, "silu")
        case "geglu" if gate is not None:
            return gated(gate, up, "gelu")
    raise ValueError(f"expert activation {activation!r} (with a gate: {gate is not None})")


def _routed(
    x: jax.Array,
    routers: dict[str, jax.Array],
    experts: dict[str, jax.Array],
    routing: Routing,
    expert_axes: tuple[str, ...],
    token_axes: tuple[str, ...],
) -> MoEResult:
    """The routed experts, in a `shard_map` where their axes split them."""
    body = _capacity_groups if routing.capacity is not None else _dropless_groups
    split = _split_axes(expert_axes)
    if not split:
        # Every expert on every device: plain arrays; XLA splits the groups over the batch axes.
        return body(x, routers, experts, routing=routing, exchange="local", expert_axes=(), stats_axes=())
    tokens = _split_axes(token_axes)
    exchanged = set(split) <= set(tokens)
    if routing.capacity is not None:
        exchange = "all_to_all" if exchanged else "psum"
    else:
        exchange = "gather" if exchanged else "psum"
    rows = PartitionSpec(tokens or None)
    nested = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside the pipeline's shard_map
    shard_map = _shard_map_with_inner_vjp if nested else jax.shard_map
    # The weights enter in f32 and the body casts them (`_weights_in`): the sums of their
    # gradients over the token axes are then f32 all-reduces. (In bf16 with an automatic axis
    # beside the manual ones, XLA's CPU compiler aborts on the all-reduce jax emits, "Invalid
    # binary instruction opcode copy"; jax 0.10.2.)
    routers = {k: w.astype(jnp.float32) for k, w in routers.items()}
    experts = {k: w.astype(jnp.float32) for k, w in experts.items()}
    return shard_map(
        functools.partial(body, routing=routing, exchange=exchange, expert_axes=split, stats_axes=tokens),
        in_specs=(rows, PartitionSpec(), PartitionSpec(split)),
        out_specs=(rows, PartitionSpec()),
        axis_names=frozenset({*tokens, *split}),
    )(x, routers, experts)


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


def _weights_in(
    routers: dict[str, jax.Array],
    experts: dict[str, jax.Array],
    dtype: str,
    token_axes: tuple[str, ...],
    expert_axes: tuple[str, ...],
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The weights inside the `shard_map`, in the compute dtype, typed as differing along the
    manual axes the activations they meet differ along (every manual axis: the tokens differ
    along the token axes, and along the experts' axes once gathered or cast so): the router
    along all of them, the experts along the token axes. Made so while still f32, so that jax's sum of each one's
    gradient over those axes (the transpose of this cast) is an f32 all-reduce. (A balancing
    bias, beside the router, stays f32.)"""
    manual = (*token_axes, *(a for a in expert_axes if a not in token_axes))
    if manual:
        routers = {name: lax.pcast(w, manual, to="varying") for name, w in routers.items()}
    across = tuple(a for a in token_axes if a not in expert_axes)
    if across:
        experts = {name: lax.pcast(w, across, to="varying") for name, w in experts.items()}
    routers = {name: w.astype(dtype) if name == "router" else w for name, w in routers.items()}
    return routers, {name: w.astype(dtype) for name, w in experts.items()}


# Sums over devices inside the experts' `shard_map`. In 16 bits, with an automatic axis left
# beside the manual ones, XLA's CPU compiler aborts on the reduction jax emits ("Invalid
# binary instruction opcode copy", jax 0.10.2: a bf16 `psum_scatter` in a shard_map manual
# over two of three axes is enough): there these sums, and the sums that are the transposes
# of a gather or of a cast to varying, run in f32.


def _sum_dtype(dtype: jnp.dtype) -> jnp.dtype:
    mesh = jax.sharding.get_abstract_mesh()
    automatic = any(mesh.shape[a] > 1 for a in mesh.axis_names if a not in mesh.manual_axes)
    return jnp.dtype(jnp.float32) if automatic and jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def _summed(y: jax.Array, axes: tuple[str, ...], scatter: bool = False) -> jax.Array:
    """psum over `axes` (with `scatter`, psum_scatter of the first dimension), in `_sum_dtype`."""
    wide = y.astype(_sum_dtype(y.dtype))
    total = lax.psum_scatter(wide, axes, scatter_dimension=0, tiled=True) if scatter else lax.psum(wide, axes)
    return total.astype(y.dtype)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """x typed as differing along `axes` (its gradient is summed over them, in `_sum_dtype`)."""
    return lax.pcast(x.astype(_sum_dtype(x.dtype)), axes, to="varying").astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The all-gather along `axes` of the first dimension, in x's dtype; its gradient is the
    reduce-scatter, in `_sum_dtype`."""
    return lax.all_gather(x, axes, axis=0, tiled=True)


def _gathered_forward(x: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, None]:
    return _gathered(x, axes), None


def _gathered_backward(axes: tuple[str, ...], _: None, cotangent: jax.Array) -> tuple[jax.Array]:
    return (_summed(cotangent, axes, scatter=True),)


_gathered.defvjp(_gathered_forward, _gathered_backward)


# ---- routing -------------------------------------------------------------------------------------


class Choices(NamedTuple):
    """The routing of groups [groups, tokens, dim]: each token's top_k experts and gates
    [groups, tokens, k], and the unweighted balance and z losses (means over the groups) and
    every expert's count of choices [experts], before any reduction over devices."""

    chosen: jax.Array
    gates: jax.Array
    balance: jax.Array
    z: jax.Array
    load: jax.Array
    signal: jax.Array  # 0, whose gradient moves a balancing bias (`_balance_signal`)


def _choose(x: jax.Array, routers: dict[str, jax.Array], routing: Routing) -> Choices:
    router, bias = routers["router"], routers.get("balance_bias")
    tokens, experts = x.shape[1], router.shape[-1]
    logits = jnp.einsum("gsd,de->gse", x, router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    scores = probs if bias is None else probs + lax.stop_gradient(bias)
    _, chosen = lax.top_k(scores, routing.top_k)  # [groups, tokens, k]
    top = jnp.take_along_axis(probs, chosen, axis=-1)
    gates = top / top.sum(-1, keepdims=True) if routing.normalize else top
    load = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32), axis=2)  # [groups, tokens, experts]
    share = load.sum(1) / (tokens * routing.top_k)  # f_e per group
    balance = experts * jnp.sum(share * probs.mean(1), axis=-1)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    counts = load.sum((0, 1))
    signal = jnp.zeros((), jnp.float32)
    if bias is not None:
        signal = _balance_signal(bias, counts / jnp.sum(counts) - 1.0 / experts)
    return Choices(chosen, gates, balance.mean(), z, counts, signal)


@jax.custom_vjp
def _balance_signal(bias: jax.Array, excess: jax.Array) -> jax.Array:
    """0, whose gradient with respect to `bias` is `excess` (each expert's share of the
    choices less the even share) times the incoming cotangent: added to the loss like the
    other auxiliary values (averaged over devices and accumulation slices), it gives the bias
    the batch's mean excess load, whatever the layout. (Computed from `excess` rather than
    made a constant, so that inside a `shard_map` it is typed as differing per device, as the
    value whose gradient it carries does.)"""
    return 0.0 * jnp.sum(excess)


def _balance_signal_forward(bias: jax.Array, excess: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _balance_signal(bias, excess), excess


def _balance_signal_backward(excess: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cotangent * excess, jnp.zeros_like(excess)


_balance_signal.defvjp(_balance_signal_forward, _balance_signal_backward)


def _aux(
    choices: Choices,
    routing: Routing,
    dropped: jax.Array,
    routed: jax.Array,
    stats_axes: tuple[str, ...],
    shared_axes: tuple[str, ...] = (),
) -> dict[str, jax.Array]:
    """The layer's auxiliary values from its routing, summed over the devices whose groups
    differ (`stats_axes`; every device holds as many groups, so a mean over groups is the
    mean of the devices' means) and averaged over those that routed the same groups
    (`shared_axes`)."""
    balance, z, load, signal = choices.balance, choices.z, choices.load, choices.signal
    if stats_axes:
        balance, z, signal = (lax.pmean(v, stats_axes) for v in (balance, z, signal))
        load, dropped, routed = (lax.psum(v, stats_axes) for v in (load, dropped, routed))
    if shared_axes:
        balance, z, signal, load, dropped, routed = (
            lax.pmean(v, shared_axes) for v in (balance, z, signal, load, dropped, routed)
        )
    z_loss = routing.z_weight * z
    return {
        AUX_LOSS: routing.aux_weight * balance + z_loss + signal,
        "moe_z_loss": z_loss,
        "moe_dropped": dropped,
        "moe_routed": routed,
        "moe_load_max": load.shape[0] * jnp.max(load) / jnp.maximum(jnp.sum(load), 1.0),
        "moe_layers": jnp.ones((), jnp.float32),
    }


# ---- capacity: one-hot dispatch into slots -------------------------------------------------------


def _capacity_groups(
    x: jax.Array,
    routers: dict[str, jax.Array],
    experts: dict[str, jax.Array],
    *,
    routing: Routing,
    exchange: str,
    expert_axes: tuple[str, ...],
    stats_axes: tuple[str, ...],
) -> MoEResult:
    """The capacity form on the groups at hand (one device's, inside `shard_map`).
    `exchange` says how the slots reach the experts: "local" (all experts are here),
    "all_to_all" or "psum" over `expert_axes`; `stats_axes` are the manual axes the groups
    are split over."""
    assert routing.capacity is not None
    shape, dtype = x.shape, routing.dtype
    routers, experts = _weights_in(routers, experts, dtype, stats_axes, expert_axes)
    x = x.astype(dtype).reshape(shape[0], -1, shape[-1])  # [groups, tokens, dim]
    if exchange == "psum":
        x = _varying(x, expert_axes)  # each device takes its experts' slots of the same tokens
    choices = _choose(x, routers, routing)
    experts_count = routers["router"].shape[-1]
    dispatch, combine, dropped = _slots(choices, experts_count, x.shape[1], routing.top_k, routing.capacity)
    if exchange == "psum":
        # The tokens are whole here, and so are the routing tables: keep this device's experts.
        mine = experts["w_in"].shape[0]
        first = lax.axis_index(expert_axes) * mine
        dispatch = lax.dynamic_slice_in_dim(dispatch, first, mine, axis=2)
        combine = lax.dynamic_slice_in_dim(combine, first, mine, axis=2)
    slots = jnp.einsum("gsec,gsd->gecd", dispatch.astype(dtype), x)  # [groups, experts, slots, dim]
    if exchange == "all_to_all":
        # Expert e's slots of every group go to the device holding e; the groups of all the
        # devices along the axes arrive stacked, [devices * groups, experts here, slots, dim].
        slots = lax.all_to_all(slots, expert_axes, 1, 0, tiled=True)
    up = jnp.einsum("gecd,edf->gecf", slots, experts["w_in"])
    gate = jnp.einsum("gecd,edf->gecf", slots, experts["w_gate"]) if "w_gate" in experts else None
    out = jnp.einsum("gecf,efd->gecd", expert_activation(up, gate, routing.activation), experts["w_out"])
    if exchange == "all_to_all":
        out = lax.all_to_all(out, expert_axes, 0, 1, tiled=True)
    y = jnp.einsum("gsec,gecd->gsd", combine.astype(dtype), out)
    if exchange == "psum":
        y = _summed(y, expert_axes)
    routed = jnp.asarray(math.prod(choices.chosen.shape), jnp.float32)
    # Tokens whole along the experts' axes: the devices along them routed the same groups.
    shared = expert_axes if exchange == "psum" else ()
    return y.reshape(shape), _aux(choices, routing, dropped, routed, stats_axes, shared)


def _slots(
    choices: Choices, experts: int, tokens: int, top_k: int, capacity: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one-hot dispatch tensor and the gate-weighted combine tensor [groups, tokens,
    experts, slots] (f32), and the count of dropped choices."""
    groups = choices.chosen.shape[0]
    slots = min(tokens, math.ceil(capacity * tokens * top_k / experts))
    choice = jax.nn.one_hot(choices.chosen, experts, dtype=jnp.int32)  # [groups, tokens, k, experts]
    # Slots are taken choice by choice (all first choices, then all second ones), in token
    # order within each: a running count per expert over that order is each choice's slot.
    order = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * tokens, experts)
    taken = (jnp.cumsum(order, axis=1) - 1) * order
    slot = taken.reshape(groups, top_k, tokens, experts).transpose(0, 2, 1, 3).sum(-1)  # [groups, tokens, k]
    # A slot past the last is a dropped choice: its one-hot row is all zeros.
    in_slot = jax.nn.one_hot(slot, slots, dtype=jnp.float32)  # [groups, tokens, k, slots]
    dispatch = jnp.einsum("gske,gskc->gsec", choice.astype(jnp.float32), in_slot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", choices.gates, choice.astype(jnp.float32), in_slot)
    return dispatch, combine, jnp.sum(slot >= slots).astype(jnp.float32)


# ---- dropless: sorted rows, grouped matrix products ----------------------------------------------


def _dropless_groups(
    x: jax.Array,
    routers: dict[str, jax.Array],
    experts: dict[str, jax.Array],
    *,
    routing: Routing,
    exchange: str,
    expert_axes: tuple[str, ...],
    stats_axes: tuple[str, ...],
) -> MoEResult:
    """The dropless form on the groups at hand (one device's, inside `shard_map`).
    `exchange`: "local" (all experts here), "gather" (the tokens of the devices along
    `expert_axes` are gathered, each computes its experts' rows, the sums are scattered back)
    or "psum" (the tokens are whole along `expert_axes`)."""
    shape, dtype, k = x.shape, routing.dtype, routing.top_k
    routers, experts = _weights_in(routers, experts, dtype, stats_axes, expert_axes)
    x = x.astype(dtype).reshape(shape[0], -1, shape[-1])  # [groups, tokens, dim]
    if exchange == "gather":
        x = _gathered(x, expert_axes)
    elif exchange == "psum":
        # Typed as differing along the experts' axes, as it will once each device picks its
        # own rows: taken from an operand typed as the same everywhere, the rows' gradient
        # comes back wrong (each device's share misplaced; measured with jax 0.10.2).
        x = _varying(x, expert_axes)
    choices = _choose(x, routers, routing)
    groups, tokens, dim = x.shape
    held = experts["w_in"].shape[0]
    expert = choices.chosen.reshape(-1)  # [choices]: choice j of token t at t * k + j
    if exchange != "local":
        # Only this device's experts: the other choices sort last, past every group.
        expert = expert - lax.axis_index(expert_axes) * held
        expert = jnp.where((expert >= 0) & (expert < held), expert, held)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(expert, held, dtype=jnp.int32), axis=0)  # the "other" choices have no column
    rows = x.reshape(-1, dim)[order // k]  # [choices, dim], by expert
    out = grouped_experts(rows, sizes, experts, routing.activation)
    # Back in token order by a gather (float arrays are only ever gathered and scatter-added
    # here: XLA's CPU compiler fails on a 16-bit scatter-set split over an automatic axis).
    unsorted = out[_inverse(order)].reshape(groups * tokens, k, dim)
    y = jnp.einsum("nk,nkd->nd", choices.gates.reshape(-1, k).astype(dtype), unsorted).reshape(groups, tokens, dim)
    computed = jnp.sum(sizes).astype(jnp.float32)
    if exchange != "local":
        computed = lax.psum(computed, expert_axes)
    if exchange == "gather":
        y = _summed(y, expert_axes, scatter=True)
    elif exchange == "psum":
        y = _summed(y, expert_axes)
    routed = jnp.asarray(groups * tokens * k, jnp.float32)
    # The devices along the experts' axes routed the same groups: sum over the others only.
    shared = expert_axes if exchange != "local" else ()
    sums = tuple(a for a in stats_axes if a not in shared)
    return y.reshape(shape), _aux(choices, routing, routed - computed, routed, sums, shared)


def grouped_experts(rows: jax.Array, sizes: jax.Array, experts: dict[str, jax.Array], activation: str) -> jax.Array:
    """Every expert's MLP on its rows: `rows` [m, dim] sorted by expert, `sizes` [experts]
    the rows of each (their sum at most m; the rows past it come out zero).

    On GPU and TPU, `lax.ragged_dot`, which XLA (and Pallas on GPU) computes as one grouped
    matrix product. On CPU jax computes a ragged dot as a dense product per expert (measured
    12x one dense product at 8 experts, 80x at 128): there the rows are padded, expert by
    expert, to whole tiles, and each tile is multiplied by its expert's matrices."""
    total = jnp.sum(sizes)
    if jax.default_backend() in ("gpu", "tpu"):

        def product(a: jax.Array, w: jax.Array) -> jax.Array:
            return lax.ragged_dot(a, w, sizes)

        up = product(rows, experts["w_in"])
        gate = product(rows, experts["w_gate"]) if "w_gate" in experts else None
        out = product(expert_activation(up, gate, activation), experts["w_out"])
        return jnp.where(jnp.arange(rows.shape[0])[:, None] < total, out, 0)
    tiles = Tiles.of(sizes, rows.shape[0])
    padded = tiles.pad(rows)  # [tiles, tile, dim]
    up = jnp.einsum("tnd,tdf->tnf", padded, experts["w_in"][tiles.expert])
    gate = jnp.einsum("tnd,tdf->tnf", padded, experts["w_gate"][tiles.expert]) if "w_gate" in experts else None
    out = jnp.einsum("tnf,tfd->tnd", expert_activation(up, gate, activation), experts["w_out"][tiles.expert])
    return tiles.unpad(out)


class Tiles(NamedTuple):
    """Rows sorted by expert, padded expert by expert to whole tiles of `size` rows, so that
    each tile belongs to one expert (`expert` [tiles]) and a grouped product is a batch of
    dense ones. `place` [m] is each row's place in the padded rows (past the end: a row
    beyond the experts' total, which no tile holds). At most ceil(m / size) + experts tiles,
    the padding at most size - 1 rows per expert."""

    size: int
    number: int
    place: jax.Array
    expert: jax.Array

    @staticmethod
    def of(sizes: jax.Array, rows: int) -> Tiles:
        experts = sizes.shape[0]
        # Tiles near the mean rows per expert keep both the padding and the tile count low.
        size = min(128, max(8, 1 << max(0, (rows // experts).bit_length() - 1)))
        number = -(-rows // size) + experts
        ends = jnp.cumsum(sizes)
        padded = (sizes + size - 1) // size * size
        padded_ends = jnp.cumsum(padded)
        row = jnp.arange(rows)
        # The expert of each row: how many experts end at or before it (`experts` past the
        # total). Counted rather than `jnp.searchsorted`, which jax 0.10.2 cannot trace inside
        # a `shard_map` when its operands vary over different axes.
        expert = _ended(ends, row)
        within = row - (ends - sizes)[jnp.minimum(expert, experts - 1)]
        place = jnp.where(expert < experts, (padded_ends - padded)[jnp.minimum(expert, experts - 1)] + within, -1)
        place = jnp.where(place < 0, number * size, place)
        first_rows = jnp.arange(number) * size
        tile_expert = jnp.minimum(_ended(padded_ends, first_rows), experts - 1)
        return Tiles(size, number, place, tile_expert)

    def pad(self, rows: jax.Array) -> jax.Array:
        # Each padded place's row (one past the last: padding), then a gather.
        total = self.number * self.size
        source = jnp.full((total,), rows.shape[0]).at[self.place].set(jnp.arange(rows.shape[0]), mode="drop")
        with_zero = jnp.concatenate([rows, jnp.zeros((1, rows.shape[-1]), rows.dtype)])
        return with_zero[source].reshape(self.number, self.size, -1)

    def unpad(self, tiles: jax.Array) -> jax.Array:
        flat = tiles.reshape(self.number * self.size, -1)
        return flat.at[self.place].get(mode="fill", fill_value=0)


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order`."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _ended(ends: jax.Array, rows: jax.Array) -> jax.Array:
    """For each of `rows`, the count of `ends` at or before it (`searchsorted(..., "right")`)."""
    return jnp.sum(rows[:, None] >= ends[None, :], axis=1)
