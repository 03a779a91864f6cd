"""Parameters made, placed and read back: fresh ones from per-name random keys (a seed gives
the same weights on any mesh), and weights by their per-layer names in and out."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .storage import Parameter, from_weights, to_weights, weight_names

Arrays = dict[str, jax.Array]  # arrays by name: parameters, their gradients, a batch


def named_key(key: jax.Array, name: str) -> jax.Array:
    """A key for one named thing (a parameter, a dropout layer), the same whatever else the
    model contains, so a seed gives the same weights whatever the mesh."""
    return jax.random.fold_in(key, zlib.crc32(name.encode()))


def initial_value(init: str, shape: tuple[int, ...], dtype: str, key: jax.Array) -> jax.Array:
    """A parameter's first value; `init` is "zeros", "ones" or "normal:STD"."""
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    if init == "ones":
        return jnp.ones(shape, dtype)
    kind, _, std = init.partition(":")
    if kind != "normal":
        raise ValueError(f"unknown initializer {init!r}")
    return (float(std) * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def initial_array(name: str, p: Parameter, key: jax.Array) -> jax.Array:
    """A stored array's first value: each weight it holds drawn from the key of its own
    per-layer name (`blocks.3.attn.q`) in its own shape, so how weights are stored (stacked,
    in rows, padded) changes no value; padding is zero."""
    held = weight_names(name, p)
    if not p.rows and len(held) == 1 and held[0].shape == p.shape:
        return initial_value(p.init, p.shape, p.dtype, named_key(key, name))
    value = jnp.zeros(p.shape, p.dtype)
    for h in held:
        piece = initial_value(h.init, h.shape, p.dtype, named_key(key, h.name))
        value = value.at[h.at + tuple(slice(0, n) for n in h.shape)].set(piece)
    return value


def init_params(parameters: dict[str, Parameter], seed: int, mesh: Mesh) -> Arrays:
    """Fresh parameters, each generated straight into its shards (never whole on one device)."""

    def create() -> Arrays:
        key = jax.random.key(seed)
        return {name: initial_array(name, p, key) for name, p in parameters.items()}

    shardings = {name: NamedSharding(mesh, p.sharding) for name, p in parameters.items()}
    made: Arrays = jax.jit(create, out_shardings=shardings)()
    return made


def export_weights(parameters: dict[str, Parameter], params: Arrays) -> dict[str, np.ndarray]:
    """Every weight by its per-layer name, as numpy arrays."""
    return to_weights(parameters, {name: jax.device_get(value) for name, value in params.items()})


def import_weights(parameters: dict[str, Parameter], weights: dict[str, np.ndarray], mesh: Mesh) -> Arrays:
    """The stored arrays for weights given by their per-layer names, placed on the mesh."""
    placed = {}
    for name, value in from_weights(parameters, weights).items():
        p = parameters[name]
        placed[name] = jax.device_put(value.astype(jnp.dtype(p.dtype)), NamedSharding(mesh, p.sharding))
    return placed
