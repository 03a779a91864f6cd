"""Fresh parameters and per-name random keys, the same in both backends for a given seed."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp


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
