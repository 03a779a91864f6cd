"""Fresh parameters and per-name random keys: a seed gives the same weights on any mesh."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from .storage import Parameter, weight_names


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
