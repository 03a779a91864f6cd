"""What a generated model's classes call around the layer kernels: an activation pinned to its
sharding, a layer's weights as its kernel takes them, a layer's random key, a block's weights
out of the stored arrays, and a repeat's layers run as one loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from .params import Arrays, named_key

Aux = dict[str, jax.Array]  # a layer's auxiliary values by name (a mixture's balancing loss)


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """Pin an array to a sharding of the current mesh; XLA inserts the collectives it implies.
    Inside `shard_map` (data parallelism, the pipeline's stages) the spec's manual axes are
    left out: along them each device holds only its own piece already."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if manual:
        names = [(entry,) if isinstance(entry, str) else tuple(entry or ()) for entry in spec]
        spec = PartitionSpec(*(tuple(a for a in axes if a not in manual) or None for axes in names))
    return lax.with_sharding_constraint(x, spec)


def weights_of(
    layer: nnx.Dict, dtype: str, gather: dict[str, PartitionSpec] | None = None, transposed: str = ""
) -> Arrays:
    """A layer's parameters by name, as its kernel takes them: in the compute `dtype`; with
    `gather`, each gathered to its sharding there first (parameters stored split over the data
    axes, ZeRO-3 and FSDP); the one named `transposed` read the other way round (a head
    reading a tied embedding's table)."""
    out = {}
    for name, param in layer.items():
        value = (param[...] if gather is None else constrain(param[...], gather[name])).astype(dtype)
        out[name] = value.T if name == transposed else value
    return out


def layer_key(key: jax.Array | None, path: str) -> jax.Array | None:
    """The random key of one layer (dropout), or None when not training."""
    return None if key is None else named_key(key, path)


def layers_of(params: Arrays, prefix: str) -> Arrays:
    """The weights under `prefix` (a block's, or a repeat's stacked ones), named relative to it."""
    return {name[len(prefix) :]: value for name, value in params.items() if name.startswith(prefix)}


def scan_layers(layers: nnx.Module, count: int, x: jax.Array, inputs: Arrays, key: jax.Array | None) -> Any:
    """A repeat's `count` layers as one `lax.scan`: `layers` holds every layer's weights stacked
    (the layer index first), and each step runs one layer on its own slice of them. One loop
    body instead of N copies keeps compile time flat in depth, and makes activation
    checkpointing save memory. A layer that returns auxiliary values as well, `(y, aux)`,
    gives them summed over the layers: `(y, aux)` for the whole run."""
    graphdef, stacked = nnx.split(layers)

    def body(h: jax.Array, step: tuple[jax.Array, Any]) -> tuple[jax.Array, Aux | None]:
        index, state = step
        layer_key = None if key is None else jax.random.fold_in(key, index)
        out = nnx.merge(graphdef, state)(h, inputs, layer_key)
        return out if isinstance(out, tuple) else (out, None)

    y, aux = lax.scan(body, x, (jnp.arange(count), stacked))
    # Each layer's auxiliary values come out stacked, one row per layer.
    return y if aux is None else (y, {name: value.sum(0) for name, value in aux.items()})
