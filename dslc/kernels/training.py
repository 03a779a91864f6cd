"""The optimizer and gradient accumulation: the parts of a training step both backends share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

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
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(int(h["decay_steps"]), warmup + 1), end_value=lr / 10
        )
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])


def make_optimizer(name: str, hyper: dict[str, float]) -> optax.GradientTransformation:
    """adamw, adam or sgd with the spec's hyperparameters; `clip` adds global-norm clipping."""
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


def accumulate_gradients(
    value_and_grad: Callable[[Any, dict[str, jax.Array], jax.Array | None], tuple[jax.Array, Any]],
    params: Any,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    steps: int,
    count: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
) -> tuple[jax.Array, Any]:
    """Mean loss and gradients over `steps` slices of the batch, one slice at a time.

    Slice j takes rows j, j+steps, j+2*steps, ...: every slice keeps rows from every data
    shard, so all devices work on every slice. Gradients are summed as they arrive; their
    mean over equal slices is the full-batch gradient of a mean loss.

    A loss that averages over the positions it counts (`count` gives their number in a
    batch: cross-entropy leaves out ignored targets) has slices of different weights: slice
    j's loss and gradients are weighed by its share of the batch's counted positions, so the
    result is the full batch's mean over its counted positions, not a mean of slice means.
    """
    if steps == 1:
        return value_and_grad(params, batch, key)
    sliced = {k: v.reshape(v.shape[0] // steps, steps, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}
    keys = jax.random.split(key, steps) if key is not None else None
    total_count = None if count is None else jnp.maximum(count(batch), 1.0)

    def one(total: tuple[jax.Array, Any], i: jax.Array) -> tuple[tuple[jax.Array, Any], None]:
        piece = {k: v[i] for k, v in sliced.items()}
        value, grads = value_and_grad(params, piece, keys[i] if keys is not None else None)
        if count is not None and total_count is not None:
            share = count(piece) / total_count
            value, grads = value * share, jax.tree.map(lambda g: g * share.astype(g.dtype), grads)
        return (total[0] + value, jax.tree.map(jnp.add, total[1], grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (value, total), _ = jax.lax.scan(one, zeros, jnp.arange(steps))
    if total_count is not None:
        return value, total
    return value / steps, jax.tree.map(lambda g: g / steps, total)


def _axes_of(dim: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names."""
    return (dim,) if isinstance(dim, str) else tuple(dim or ())


def spec_axes(spec: PartitionSpec, axes: Any, *, keep: bool) -> PartitionSpec:
    """`spec` with only the mesh axes in `axes` (`keep`), or with all but them."""

    def entry(dim: Any) -> Any:
        kept = tuple(a for a in _axes_of(dim) if (a in axes) == keep)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(entry(dim) for dim in spec))


def data_parallel_gradients(
    value_and_grad: Callable[[Any, dict[str, jax.Array], jax.Array | None], tuple[jax.Array, Any]],
    params: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    *,
    axes: tuple[str, ...],
    param_specs: dict[str, PartitionSpec],
    grad_specs: dict[str, PartitionSpec],
    batch_specs: dict[str, PartitionSpec],
    count: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`value_and_grad` over the whole batch with the data-parallel sum written out, as ZeRO
    does it: each data shard differentiates its own rows, and each gradient is
    reduce-scattered over the data `axes` to the piece `grad_specs` gives it (all-reduced
    where that splits it over none of them) — one collective per gradient, with half an
    all-reduce's traffic, instead of all-reducing it whole and slicing.

    Two maps: the first is manual over `axes` alone (every other axis stays with XLA's
    partitioner, which splits the model as the spec says) and returns each shard's gradients
    unsummed, stacked along a new leading dimension; the second is manual over the whole
    mesh and reduce-scatters each device's own block (a collective in a map that leaves some
    axes automatic is first gathered whole over them). Each shard's mean loss weighs 1/N,
    or, for a loss that averages over the positions it counts (`count`), its share of the
    batch's counted positions. Each shard draws its own random numbers (dropout), from `key`
    folded with its index.
    """
    stacked = PartitionSpec(axes)

    def shard(params: dict[str, jax.Array], batch: dict[str, jax.Array], key: jax.Array | None) -> Any:
        if key is not None:
            key = jax.random.fold_in(key, lax.axis_index(axes))
        value, grads = value_and_grad(params, batch, key)
        if count is None:
            share = jnp.float32(1.0 / lax.axis_size(axes))
        else:
            mine = count(batch).astype(jnp.float32)
            share = mine / jnp.maximum(lax.psum(mine, axes), 1.0)
        grads = {
            name: lax.with_sharding_constraint(
                (g * share.astype(g.dtype))[None], PartitionSpec(None, *param_specs[name])
            )
            for name, g in grads.items()
        }
        return lax.psum(value * share, axes), grads

    def reduce(grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for name, g in grads.items():
            scatter = [d for d, where in enumerate(grad_specs[name]) if set(_axes_of(where)) & set(axes)]
            if scatter:
                where = tuple(a for a in _axes_of(grad_specs[name][scatter[0]]) if a in axes)
                out[name] = lax.psum_scatter(g[0], where, scatter_dimension=scatter[0], tiled=True)
            else:
                out[name] = lax.psum(g[0], axes)
        return out

    value, local = jax.shard_map(
        shard,
        in_specs=(
            {name: PartitionSpec() for name in params},
            {name: spec_axes(batch_specs[name], axes, keep=True) for name in batch},
            PartitionSpec(),
        ),
        out_specs=(PartitionSpec(), {name: stacked for name in params}),
        axis_names=set(axes),
        # The gradients are taken inside, per shard, and summed explicitly: nothing
        # differentiates through these maps, so replication needs no tracking.
        check_vma=False,
    )(params, batch, key)
    grads = jax.shard_map(
        reduce,
        in_specs=({name: PartitionSpec(axes, *spec) for name, spec in param_specs.items()},),
        out_specs={name: grad_specs[name] for name in params},
        axis_names=set(jax.sharding.get_abstract_mesh().axis_names),
        check_vma=False,
    )(local)
    return value, grads  # type: ignore[return-value]
