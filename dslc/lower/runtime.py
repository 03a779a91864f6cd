"""What the interpreter carries while it runs a model: the mesh, the batch, the mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from dslc.ir.nodes import Sharding
from dslc.kernels.params import named_key

JNP_DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f64": jnp.float64,
    "i32": jnp.int32,
    "i64": jnp.int64,
    "i8": jnp.int8,
    "bool": jnp.bool_,
}


def partition_spec(sharding: Sharding) -> PartitionSpec:
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in sharding))


@dataclass
class Runtime:
    mesh: jax.sharding.Mesh
    compute_dtype: Any
    inputs: dict[str, jax.Array]
    training: bool = False
    dropout_key: jax.Array | None = None
    # Inside the pipeline executor the stage axis is manual: shardings are then given as
    # bare specs over the remaining (automatic) axes of the context mesh.
    manual_axes: tuple[str, ...] = ()

    def constrain(self, x: jax.Array, sharding: Sharding) -> jax.Array:
        """Pin an activation to the sharding the IR gave it; XLA places the collectives."""
        if self.manual_axes:
            return jax.lax.with_sharding_constraint(x, partition_spec(sharding))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, partition_spec(sharding)))

    def rng(self, path: str) -> jax.Array:
        assert self.dropout_key is not None, "dropout while training needs a key"
        return named_key(self.dropout_key, path)

    def name(self, x: jax.Array, path: str) -> jax.Array:
        """Tag an output so selective checkpointing can choose to keep it."""
        return checkpoint_name(x, path)
