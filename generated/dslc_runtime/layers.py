"""One function per layer kind, on global (logical) arrays.

Conventions, shared by every kernel (attention's are in `attention.py`, the mixture of experts'
in `experts.py`) so that a generated module calls them alike:
the input activation is the first argument; weights follow as keyword arguments named as
the layer rule names them (already cast to the compute dtype); then the layer's static
arguments, keyword-only; `dtype` is the compute dtype's name. Sharding is not a kernel's
business: the caller pins inputs and outputs to the shardings the checker gave them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

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
