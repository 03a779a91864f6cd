"""The optimizer, gradient accumulation, data parallelism and the jitted optimizer step: the
parts of a training step that do not depend on the spec."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .metrics import step_metrics
from .params import Arrays
from .storage import Parameter, axes_of

# The mean loss and the gradients of the parameters over a batch: (params, batch, key, mesh).
Gradients = Callable[[Arrays, Arrays, jax.Array | None, Mesh], tuple[jax.Array, Arrays]]

OPTIMIZER_DEFAULTS = {
    "lr": 1e-3,
    "b1": 0.9,
    "b2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "momentum": 0.9,
    "warmup": 0.0,
}


def learning_rate(hyper: dict[str, float]) -> optax.Schedule:
    """Linear warm-up to `lr`, then constant, or cosine decay to lr/10 over `decay_steps`."""
    h = {**OPTIMIZER_DEFAULTS, **hyper}
    lr, warmup = h["lr"], int(h["warmup"])
    if "decay_steps" in h:
        steps = max(int(h["decay_steps"]), warmup + 1)
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])


def make_optimizer(
    name: str, hyper: dict[str, float], balanced: dict[str, float] | None = None
) -> optax.GradientTransformation:
    """adamw, adam or sgd with the spec's hyperparameters; `clip` adds global-norm clipping.
    The parameters named in `balanced` (a mixture of experts' balancing biases, whose
    "gradient" is each expert's excess load) take none of that: each moves by its rate
    against the sign of its gradient (DeepSeek-V3's update), outside the clipping."""
    main = _main_optimizer(name, hyper)
    if not balanced:
        return main
    rates = {rate: f"balance {rate!r}" for rate in sorted(set(balanced.values()))}
    transforms = {"main": main} | {
        label: optax.chain(optax.scale_by_sign(), optax.scale(-rate)) for rate, label in rates.items()
    }

    def labels(params: dict[str, Any]) -> dict[str, str]:
        return {name: rates[balanced[name]] if name in balanced else "main" for name in params}

    return optax.multi_transform(transforms, labels)


def _main_optimizer(name: str, hyper: dict[str, float]) -> optax.GradientTransformation:
    h = {**OPTIMIZER_DEFAULTS, **hyper}
    lr = learning_rate(hyper)
    if name == "adamw":
        core = optax.adamw(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"])
    elif name == "adam":
        core = optax.adam(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"])
    elif name == "sgd":
        core = optax.sgd(lr, momentum=h["momentum"])
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    return optax.chain(optax.clip_by_global_norm(h["clip"]), core) if "clip" in h else core


def master_state(optimizer: optax.GradientTransformation, params: Any, dtype: str) -> dict[str, Any]:
    """The optimizer state of mixed-precision training: a `dtype` (f32) master copy of the
    16-bit parameters and the optimizer's own state of it (its moments in that dtype too), as
    ZeRO and Megatron's distributed optimizer keep them. The master starts as the parameters'
    exact value."""
    master = jax.tree.map(lambda p: p.astype(dtype), params)
    return {"master": master, "optimizer": optimizer.init(master)}


def master_update(
    optimizer: optax.GradientTransformation, grads: Any, state: dict[str, Any], params: Any
) -> tuple[Any, dict[str, Any]]:
    """One optimizer step on the master copy (`master_state`): the 16-bit gradients widened to
    the master's dtype, the update applied there, and the parameters written back as the new
    master rounded to their own dtype. Returns (parameters, state)."""
    master = state["master"]
    grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
    updates, inner = optimizer.update(grads, state["optimizer"], master)
    master = optax.apply_updates(master, updates)
    return jax.tree.map(lambda m, p: m.astype(p.dtype), master, params), {"master": master, "optimizer": inner}


def optimizer_state(optimizer: optax.GradientTransformation, params: Any, master_dtype: str | None = None) -> Any:
    """The optimizer's own state of the parameters; with `master_dtype`, of a master copy of
    them in that dtype, kept beside it (`master_state`)."""
    return optimizer.init(params) if master_dtype is None else master_state(optimizer, params, master_dtype)


def optimizer_shardings(parameters: dict[str, Parameter], state: Any, mesh: Mesh) -> Any:
    """Where each leaf of an optimizer state lives: one shaped like a parameter (its moments,
    its master copy) follows the parameter's optimizer sharding (its ZeRO split), anything
    else (step counts) is replicated."""

    def pick(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        for entry in path:
            name = getattr(entry, "key", None)
            if name in parameters and tuple(leaf.shape) == parameters[name].shape:
                return NamedSharding(mesh, parameters[name].update_sharding)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(pick, state)


def abstract_state(
    parameters: dict[str, Parameter],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    master_dtype: str | None = None,
) -> Any:
    """The optimizer state of `parameters` as shapes, dtypes and the shardings it lives in
    (`optimizer_shardings`), without allocating anything."""
    params = {name: jax.ShapeDtypeStruct(p.shape, p.dtype) for name, p in parameters.items()}
    state = jax.eval_shape(functools.partial(optimizer_state, optimizer, master_dtype=master_dtype), params)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        state,
        optimizer_shardings(parameters, state, mesh),
    )


def _shardings(abstract: Any) -> Any:
    return jax.tree.map(lambda leaf: leaf.sharding, abstract)


def init_optimizer(
    parameters: dict[str, Parameter],
    params: Arrays,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    master_dtype: str | None = None,
) -> Any:
    """The optimizer state of `params`, made where it lives (split as the ZeRO stage says)."""
    init = functools.partial(optimizer_state, optimizer, master_dtype=master_dtype)
    return jax.jit(init, out_shardings=_shardings(abstract_state(parameters, optimizer, mesh, master_dtype)))(params)


def make_train_step(
    gradients: Gradients,
    parameters: dict[str, Parameter],
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    master_dtype: str | None = None,
    metrics: bool = True,
) -> Callable[..., Any]:
    """One jitted optimizer step: (params, optimizer state, batch, key) -> the new two, the loss
    and the step's figures (`step_metrics`; none without `metrics`, sparing their collectives).
    Parameters and state are donated: updated in place."""
    # Each gradient where its optimizer state lives: its piece of it under ZeRO.
    grad_shardings = {name: NamedSharding(mesh, p.update_sharding) for name, p in parameters.items()}
    param_shardings = {name: NamedSharding(mesh, p.sharding) for name, p in parameters.items()}
    state_shardings = _shardings(abstract_state(parameters, optimizer, mesh, master_dtype))

    def step(params: Arrays, opt_state: Any, batch: Arrays, key: jax.Array) -> tuple[Arrays, Any, jax.Array, Arrays]:
        value, grads = gradients(params, batch, key, mesh)
        grads = lax.with_sharding_constraint(grads, grad_shardings)
        figures = step_metrics(grads) if metrics else {}
        if master_dtype is not None:
            # The update runs on the master copy; the parameters are its rounding to their dtype.
            params, opt_state = master_update(optimizer, grads, opt_state, params)
            return params, opt_state, value, figures
        # The update reads the gradients in the parameters' dtype (summed wider under
        # `grad_dtype`, with no master copy to update).
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, figures

    replicated = NamedSharding(mesh, PartitionSpec())
    outputs = (param_shardings, state_shardings, replicated, replicated)
    return jax.jit(step, out_shardings=outputs, donate_argnums=(0, 1))


def accumulate_gradients(
    value_and_grad: Callable[[Any, dict[str, jax.Array], jax.Array | None], tuple[jax.Array, Any]],
    params: Any,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    steps: int,
    count: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
    grad_dtype: str | None = None,
) -> tuple[jax.Array, Any]:
    """Mean loss and gradients over `steps` slices of the batch, one slice at a time.

    Slice j takes rows j, j+steps, j+2*steps, ...: every slice keeps rows from every data
    shard, so all devices work on every slice. Gradients are summed as they arrive; their
    mean over equal slices is the full-batch gradient of a mean loss.

    A loss that averages over the positions it counts (`count` gives their number in a
    batch: cross-entropy leaves out ignored targets) has slices of different weights: slice
    j's loss and gradients are weighed by its share of the batch's counted positions, so the
    result is the full batch's mean over its counted positions, not a mean of slice means.

    `grad_dtype` (f32 beside 16-bit parameters, Megatron's `main_grad`): the sum is kept in it,
    each slice's gradients widened as they are added, so that no slice's contribution is
    rounded away by the others'.
    """
    if steps == 1:
        return widened(value_and_grad(params, batch, key), grad_dtype)
    sliced = {k: v.reshape(v.shape[0] // steps, steps, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}
    keys = jax.random.split(key, steps) if key is not None else None
    total_count = None if count is None else jnp.maximum(count(batch), 1.0)

    def one(total: tuple[jax.Array, Any], i: jax.Array) -> tuple[tuple[jax.Array, Any], None]:
        piece = {k: v[i] for k, v in sliced.items()}
        value, grads = value_and_grad(params, piece, keys[i] if keys is not None else None)
        if count is not None and total_count is not None:
            share = count(piece) / total_count
            value, grads = value * share, jax.tree.map(lambda g: g * share.astype(g.dtype), grads)
        return (total[0] + value, jax.tree.map(lambda t, g: t + g.astype(t.dtype), total[1], grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(lambda p: jnp.zeros_like(p, grad_dtype or p.dtype), params))
    (value, total), _ = jax.lax.scan(one, zeros, jnp.arange(steps))
    if total_count is not None:
        return value, total
    return value / steps, jax.tree.map(lambda g: g / steps, total)


def widened(result: tuple[jax.Array, Any], grad_dtype: str | None) -> tuple[jax.Array, Any]:
    """(loss, gradients) with the gradients in `grad_dtype`, when given (the dtype a step sums
    and returns them in: f32 beside 16-bit parameters, the `grad_dtype` setting)."""
    if grad_dtype is None:
        return result
    return result[0], jax.tree.map(lambda g: g.astype(grad_dtype), result[1])


def data_parallel(
    value_and_grad: Callable[[Any, dict[str, jax.Array], jax.Array | None], tuple[jax.Array, Any]],
    params: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    *,
    mesh: jax.sharding.Mesh,
    axes: tuple[str, ...],
    parameters: dict[str, Parameter],
    count: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
    grad_dtype: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean loss and gradients over the batch, each device working through its own rows of
    it, the gradients summed over the data-parallel `axes` once, at the end.

    `value_and_grad(params, rows, key)` runs in `jax.shard_map`, manual over `axes` (the other
    mesh axes stay automatic), on this device's rows of every input and the parameters, whole
    along `axes`. It returns its rows' mean loss and gradients: partial sums on each device,
    however many slices it cuts its rows into (microbatches, accumulation steps), rather than
    reduced per slice as XLA's partitioner would where each is made.

    A second map, manual over the whole mesh, sums each device's block of them once: a
    reduce-scatter where the parameter's `update_sharding` keeps the gradient split over `axes`
    (ZeRO 2, and ZeRO 1's optimizer state, whose pieces the update runs on), else an
    all-reduce. There each device holds just its own piece along the other axes, so nothing is
    gathered over them first (and XLA's CPU backend, which cannot promote a 16-bit all-reduce
    in a partly manual map, has none to promote).

    Each device weighs by its share of the batch (of its counted positions, for a loss that
    averages over those: `count`), so the result is the whole batch's mean. Each device draws
    its own random numbers (its key folded with its index along `axes`). `grad_dtype`: the
    devices' gradients are summed in it (f32 beside 16-bit parameters).
    """
    devices = math.prod(mesh.shape[a] for a in axes)
    # A device's block of each gradient: the parameter's sharding, behind the new dimension.
    blocks = {name: PartitionSpec(None, *parameters[name].sharding) for name in params}

    def body(
        params: dict[str, jax.Array], rows: dict[str, jax.Array], key: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        mine = jax.random.fold_in(key, lax.axis_index(axes)) if key_given else None
        loss, grads = widened(value_and_grad(params, rows, mine), grad_dtype)
        if count is None:
            share = jnp.asarray(1.0 / devices, jnp.float32)
        else:
            counted = count(rows).astype(jnp.float32)
            share = counted / jnp.maximum(lax.psum(counted, axes), 1.0)
        weighed = {name: (g * share.astype(g.dtype))[None] for name, g in grads.items()}
        return lax.psum(loss * share, axes), lax.with_sharding_constraint(weighed, blocks)

    def reduce(grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {name: _sum_into(g[0], parameters[name], axes, mesh) for name, g in grads.items()}

    key_given = key is not None
    # The parameters whole along `axes`, the batch and the gradients' blocks split over them.
    # Gradients are taken inside, per device: replication needs no tracking (`check_vma`;
    # with it, jax would sum every slice's gradient over `axes` as it is made).
    whole, split = PartitionSpec(), PartitionSpec(axes)
    loss, stacked = jax.shard_map(
        body, mesh=mesh, in_specs=(whole, split, whole), out_specs=(whole, split), axis_names=set(axes), check_vma=False
    )(params, batch, key if key is not None else jax.random.key(0))
    # The sum, manual over the whole mesh: each device's block, its own piece along every axis.
    stacked_specs = {name: PartitionSpec(axes, *parameters[name].sharding) for name in params}
    summed_specs = {name: parameters[name].update_sharding for name in params}
    summed = jax.shard_map(reduce, mesh=mesh, in_specs=(stacked_specs,), out_specs=summed_specs, check_vma=False)
    return loss, summed(stacked)


def _sum_into(block: jax.Array, parameter: Parameter, axes: tuple[str, ...], mesh: jax.sharding.Mesh) -> jax.Array:
    """This device's piece, where the optimizer updates it (`update_sharding`), of a gradient's
    sum over `axes`, from its block (its partial sum, held as the parameter is). ZeRO adds
    axes after those a dimension holds (`ir.state.spread`), data-parallel or not (a batch over
    `(data, expert)`: XLA sums `expert` inside the step). Slowest-varying first, an added one
    of `axes` is reduce-scattered over; any other holds the same block on each of its devices,
    which keeps its own part (a slice). The rest of `axes` is all-reduced."""
    scattered: set[str] = set()
    for dim, entry in enumerate(parameter.update_sharding):
        held = axes_of(parameter.sharding[dim]) if dim < len(parameter.sharding) else ()
        added = axes_of(entry)
        assert added[: len(held)] == held, (parameter, dim)  # ZeRO only ever adds axes
        for axis in added[len(held) :]:
            if axis in axes:
                block = lax.psum_scatter(block, axis, scatter_dimension=dim, tiled=True)
                scattered.add(axis)
            else:
                size = block.shape[dim] // mesh.shape[axis]
                block = lax.dynamic_slice_in_dim(block, lax.axis_index(axis) * size, size, dim)
    whole = tuple(a for a in axes if a not in scattered)
    return lax.psum(block, whole) if whole else block
