"""One function per layer kind, on global (logical) arrays.

Conventions, shared by every kernel so that both backends can call them the same way:
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


# ---- attention -----------------------------------------------------------------------------------


def attention(
    x: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    o: jax.Array,
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    rope: bool,
    rope_base: float,
    dtype: str,
) -> jax.Array:
    """Self-attention on [batch, seq, dim]; grouped-query when kv_heads < heads."""
    b, s, _ = x.shape
    head_dim = q.shape[-1] // heads
    x = x.astype(dtype)
    queries = jnp.einsum("bsd,de->bse", x, q).reshape(b, s, heads, head_dim)
    keys = jnp.einsum("bsd,de->bse", x, k).reshape(b, s, kv_heads, head_dim)
    values = jnp.einsum("bsd,de->bse", x, v).reshape(b, s, kv_heads, head_dim)
    if rope:
        queries, keys = rotary(queries, rope_base), rotary(keys, rope_base)
    # Grouped-query: the query heads form kv_heads groups, each sharing one key/value head.
    queries = queries.reshape(b, s, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", queries, keys).astype(jnp.float32) * head_dim**-0.5
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, values).reshape(b, s, heads * head_dim)
    return jnp.einsum("bse,ed->bsd", out, o)


def rotary(t: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half layout)."""
    s, head_dim = t.shape[1], t.shape[-1]
    half = head_dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    t1, t2 = t[..., :half].astype(jnp.float32), t[..., half:].astype(jnp.float32)
    return jnp.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos], axis=-1).astype(t.dtype)


# ---- mixture of experts --------------------------------------------------------------------------


def moe(x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array, *, top_k: int, dtype: str) -> jax.Array:
    # Exact top-k mixture: every expert sees every token and the gates pick k of them.
    # No token is dropped, so `capacity` does not change the result here.
    x = x.astype(dtype)
    probs = jax.nn.softmax(jnp.einsum("...d,de->...e", x, router).astype(jnp.float32), axis=-1)
    top, chosen = lax.top_k(probs, top_k)
    gates = top / top.sum(-1, keepdims=True)
    combine = jnp.einsum("...k,...ke->...e", gates, jax.nn.one_hot(chosen, router.shape[-1], dtype=jnp.float32))
    hidden = jax.nn.gelu(jnp.einsum("...d,edf->...ef", x, w_in), approximate=True)
    per_expert = jnp.einsum("...ef,efd->...ed", hidden, w_out)
    return jnp.einsum("...e,...ed->...d", combine.astype(dtype), per_expert)


# ---- elementwise ---------------------------------------------------------------------------------


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


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


# ---- losses (f32, mean over every position) ------------------------------------------------------


def cross_entropy(logits: jax.Array, *, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    # The target logit picked by a one-hot product: over vocab-split logits this is a local
    # partial sum and one all-reduce (Megatron's vocab-parallel cross-entropy).
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def mse(x: jax.Array, *, targets: jax.Array) -> jax.Array:
    diff = x.astype(jnp.float32) - targets.astype(jnp.float32)
    return jnp.mean(diff * diff)
