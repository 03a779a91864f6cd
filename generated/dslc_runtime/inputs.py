"""A model's inputs: what each is (shape, dtype, sharding), a batch of them put on the mesh, and
a random one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class Input(NamedTuple):
    """An input of the model: its shape, dtype and sharding; integer inputs are ids below `bound`."""

    shape: tuple[int, ...]
    dtype: str
    sharding: PartitionSpec
    bound: int


def place(inputs: Mapping[str, Input], batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Put each input `batch` holds on the mesh with its declared sharding. Every process holds
    the whole batch and builds only its own devices' shards (a `device_put` onto a mesh that
    spans processes would all-gather it to compare first)."""
    placed: dict[str, jax.Array] = {}
    for name, spec in inputs.items():
        if name in batch:
            value = np.asarray(batch[name]).astype(np.dtype(jax.numpy.dtype(spec.dtype)))
            sharding = NamedSharding(mesh, spec.sharding)
            placed[name] = jax.make_array_from_callback(value.shape, sharding, value.__getitem__)
    return placed


def random_batch(inputs: Mapping[str, Input], seed: int) -> dict[str, np.ndarray]:
    """Random inputs: integer ids below each input's bound, floats from a standard normal."""
    rng = np.random.default_rng(seed)
    batch = {}
    for name, spec in inputs.items():
        dtype = np.dtype(jax.numpy.dtype(spec.dtype))
        if np.issubdtype(dtype, np.integer):
            batch[name] = rng.integers(0, spec.bound, size=spec.shape).astype(dtype)
        else:
            batch[name] = rng.standard_normal(spec.shape).astype(dtype)
    return batch
