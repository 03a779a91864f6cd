"""Attention: the layer, its cores, and ring attention (context parallelism).

The layer projects the input into query, key and value heads, rotates them (rotary
embeddings), computes its core — softmax(q·kᵀ/sqrt(d) + mask)·v — and projects the heads
out. The core comes in two algorithms, which the spec chooses (`attention(..., kernel=)`;
by sequence length when it does not):

* `dense`: every score [batch, heads, seq, seq] at once, in f32. Simple and fast for short
  sequences; its backward pass keeps the probabilities, which grows with the square of
  the sequence.
* `flash`: block by block with an online softmax, keeping only the output and each query
  row's log-sum-exp for the backward pass, which recomputes the probabilities a block at a
  time (Dao et al.'s FlashAttention). Per backend, the fused kernel that computes exactly
  this where one applies: cuDNN's (through `jax.nn.dot_product_attention`) on NVIDIA GPUs
  for 16-bit heads of a width it takes, Pallas splash attention on TPUs; elsewhere (CPU, and
  every case a fused kernel does not take) `flash_attention`, plain JAX with its own VJP.

Masks: `causal` (a query sees the keys at or before it), a sliding `window` (and only the
`window` latest of those, itself included: Mistral's, Gemma's local layers'), and `segments`
(ids [batch, seq] of the documents packed into one sequence: a query sees only keys of its
own document, and rotary positions restart at each document).

Ring attention is the flash algorithm with the key/value blocks on other devices: the block
statistics, their merge and the block gradients below are the same code for both.

Arrays inside the cores: queries [b, s, kv_heads, group, head_dim] (grouped-query: each
key/value head serves `group` query heads), keys and values [b, s, kv_heads, head_dim];
softmax statistics per query row in f32: the running maximum and the denominator
[b, kv_heads, group, s], the unnormalised output [b, kv_heads, group, s, head_dim].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from .fused import flash_implementation
from .layers import capped, rmsnorm


def attention(
    x: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    o: jax.Array,
    q_bias: jax.Array | None = None,
    k_bias: jax.Array | None = None,
    v_bias: jax.Array | None = None,
    o_bias: jax.Array | None = None,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    segments: jax.Array | None = None,
    memory: jax.Array | None = None,
    position_bias: jax.Array | None = None,
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    window: int | None = None,
    kernel: str = "dense",
    block: int = 0,
    rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    norm_eps: float = 1e-6,
    softcap: float | None = None,
    scale: float | None = None,
    dtype: str,
    recompute_core: bool = False,
) -> jax.Array:
    """Self-attention on [batch, seq, dim]; grouped-query when kv_heads < heads. Each
    projection adds its bias when it has one. `rope(t, positions)` (`rotary`, its base bound)
    encodes the tokens' places in their sequence (their document, given `segments`) into
    the queries and the keys. `kernel` is the core's algorithm, "dense" or "flash" (in
    blocks of `block` tokens, which divides the sequence). With
    `recompute_core` the dense core is checkpointed: the backward pass reruns its scores and
    softmax from the kept queries and keys rather than keeping its [batch, heads, seq, seq]
    intermediates (Korthikanti et al.'s selective recomputation; the flash core keeps none).
    With `q_norm` and `k_norm` every head's query and key is RMS-normalised (`norm_eps`) and
    scaled by them before the rotary (Qwen3's, OLMo 2's query-key norm). `softcap` caps the
    scaled scores at softcap * tanh(s / softcap) before the mask and softmax (Gemma 2's).

    Cross-attention: with `memory` [batch, keys, dim] the keys and values are projected from
    it rather than from x (an encoder's output; no mask, no rotary). `position_bias`
    [1, heads, seq, keys] is added to the scaled scores (T5's relative position bias; the
    dense core). `scale` multiplies q·k in place of 1/sqrt(head_dim): the queries are scaled
    by scale * sqrt(head_dim), so every core computes it unchanged."""
    b, s, _ = x.shape
    h = x.astype(dtype)
    m = h if memory is None else memory.astype(dtype)
    queries, keys, values = _heads(h, q, q_bias, heads), _heads(m, k, k_bias, kv_heads), _heads(m, v, v_bias, kv_heads)
    queries, keys = _head_norm(queries, q_norm, norm_eps), _head_norm(keys, k_norm, norm_eps)
    head_dim = queries.shape[-1]
    if rope is not None:
        positions = jnp.arange(s) if segments is None else document_positions(segments)
        queries, keys = rope(queries, positions), rope(keys, positions)
    if scale is not None:
        queries = queries * jnp.asarray(scale * head_dim**0.5, queries.dtype)
    # Grouped-query: the query heads form kv_heads groups, each sharing one key/value head.
    queries = queries.reshape(b, s, kv_heads, heads // kv_heads, head_dim)
    mask = Mask(causal, window)
    if kernel == "flash":
        out = flash_core(queries, keys, values, segments, mask=mask, block=block, softcap=softcap)
    else:
        core = functools.partial(dense_core, mask=mask, softcap=softcap)
        out = (jax.checkpoint(core) if recompute_core else core)(queries, keys, values, segments, position_bias)
    return _project_out(out.reshape(b, s, heads * head_dim), o, o_bias)


def relative_position_bias(
    x: jax.Array, table: jax.Array, *, bidirectional: bool, max_distance: int, dtype: str
) -> jax.Array:
    """T5's relative position bias [1, heads, seq, seq] for the sequence of x [batch, seq, ...]:
    row `bucket` of table [buckets, heads] for each query and key, the bucket of the distance
    key - query. Half of the buckets (of each direction's, when `bidirectional`) hold exact
    distances 0 .. n - 1; the rest spread logarithmically out to `max_distance`, and farther
    keys share the last one. Without `bidirectional` a key after its query is at distance 0."""
    s = x.shape[1]
    at = jnp.arange(s)
    distance = at[None, :] - at[:, None]  # [query, key]
    buckets = table.shape[0]
    bucket = jnp.zeros_like(distance)
    if bidirectional:
        buckets //= 2
        bucket = jnp.where(distance > 0, buckets, 0)
        distance = jnp.abs(distance)
    else:
        distance = jnp.maximum(-distance, 0)
    exact = buckets // 2
    # log(d / exact) / log(max_distance / exact) of the way from `exact` to the last bucket;
    # d of at least 1 inside the log, whose value is used only from `exact` on.
    far = exact + (
        jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
        / math.log(max_distance / exact)
        * (buckets - exact)
    ).astype(distance.dtype)
    bucket = bucket + jnp.where(distance < exact, distance, jnp.minimum(far, buckets - 1))
    return jnp.moveaxis(table[bucket], -1, 0)[None].astype(dtype)


def document_positions(segments: jax.Array) -> jax.Array:
    """Each token's place in its own document [b, s]: documents are runs of equal ids."""
    s = segments.shape[-1]
    index = jnp.broadcast_to(jnp.arange(s), segments.shape)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - lax.cummax(jnp.where(starts, index, 0), axis=1)


def _heads(x: jax.Array, w: jax.Array, bias: jax.Array | None, n: int) -> jax.Array:
    """x [b, s, dim] projected by w (and its bias) into n heads: [b, s, n, head_dim]."""
    y = jnp.einsum("bsd,de->bse", x, w)
    return (y if bias is None else y + bias).reshape(*x.shape[:2], n, w.shape[-1] // n)


def _head_norm(t: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm over each head's features [b, s, n, head_dim] (statistics in f32); t itself
    without a scale."""
    return t if scale is None else rmsnorm(t, scale, eps=eps, dtype=str(t.dtype))


def _project_out(heads_out: jax.Array, o: jax.Array, o_bias: jax.Array | None) -> jax.Array:
    y = jnp.einsum("bse,ed->bsd", heads_out, o)
    return y if o_bias is None else y + o_bias


def rotary(t: jax.Array, positions: jax.Array, *, base: float, dims: int | None = None) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half layout);
    `positions` [seq] or [batch, seq] are the tokens' places in their sequence. With `dims`
    only each head's first `dims` features are rotated (their own frequencies), the rest
    pass as they are."""
    if dims is not None and dims < t.shape[-1]:
        return jnp.concatenate([rotary(t[..., :dims], positions, base=base), t[..., dims:]], axis=-1)
    half = t.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    # [seq, half] or [batch, seq, half], as [batch or 1, seq, 1 (heads), half].
    angles = angles[None, :, None, :] if angles.ndim == 2 else angles[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    t1, t2 = t[..., :half].astype(jnp.float32), t[..., half:].astype(jnp.float32)
    return jnp.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos], axis=-1).astype(t.dtype)


# ---- masks -----------------------------------------------------------------------------------------


class Mask:
    """Which keys a query sees, by position: causal, and within a sliding window."""

    def __init__(self, causal: bool, window: int | None) -> None:
        self.causal, self.window = causal, window

    def visible(self, queries: jax.Array, keys: jax.Array) -> jax.Array | None:
        """[len(queries), len(keys)] of the positions given; None when every key is visible."""
        if not self.causal:
            return None
        distance = queries[:, None] - keys[None, :]
        seen = distance >= 0
        return seen if self.window is None else seen & (distance < self.window)

    def key_blocks(self, i: jax.Array, block: int, blocks: int) -> tuple[jax.Array, jax.Array]:
        """The key blocks query block i sees any key of: [first, last]."""
        if not self.causal:
            return jnp.asarray(0), jnp.asarray(blocks - 1)
        first = 0 if self.window is None else jnp.maximum(i * block - self.window + 1, 0) // block
        return jnp.asarray(first), i

    def query_blocks(self, j: jax.Array, block: int, blocks: int) -> tuple[jax.Array, jax.Array]:
        """The query blocks that see any key of key block j: [first, last]."""
        if not self.causal:
            return jnp.asarray(0), jnp.asarray(blocks - 1)
        last = (
            blocks - 1
            if self.window is None
            else jnp.minimum((j * block + block - 1 + self.window - 1) // block, blocks - 1)
        )
        return j, jnp.asarray(last)


def _mask_of(mask: Mask, q_at: jax.Array, k_at: jax.Array, segments: jax.Array | None) -> jax.Array | None:
    """The visibility [q, k] (positions) or [b, q, k] (documents too) of queries at `q_at`
    and keys at `k_at`; None when every key is visible."""
    seen = mask.visible(q_at, k_at)
    if segments is None:
        return seen
    same = segments[:, q_at][:, :, None] == segments[:, k_at][:, None, :]
    return same if seen is None else same & seen


# ---- the dense core ---------------------------------------------------------------------------------


def dense_core(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    segments: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    mask: Mask,
    softcap: float | None = None,
) -> jax.Array:
    """softmax(q·kᵀ/sqrt(d) + bias + mask)·v with every score at once; scores and softmax in
    f32. With `softcap` the scores are capped first, which keeps them (f32) for the cap's
    gradient. `bias` [1, heads, queries, keys] (a position bias) is added after the cap."""
    s, head_dim = queries.shape[1], queries.shape[-1]
    at = jnp.arange(s)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", queries, keys).astype(jnp.float32) * head_dim**-0.5
    if softcap is not None:
        scores = capped(scores, softcap)
    if bias is not None:
        # [1, heads, q, k] as the scores' [1, kv_heads, group, q, k]: head i is group member
        # i % group of key/value head i // group, as the queries were grouped.
        scores = scores + bias.astype(jnp.float32).reshape(bias.shape[0], *scores.shape[1:3], *bias.shape[2:])
    seen = _mask_of(mask, at, at, segments)
    if seen is not None:
        seen = seen[:, None, None] if seen.ndim == 3 else seen
    probs = _softmax(scores, seen, str(queries.dtype))
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, values)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(scores: jax.Array, seen: jax.Array | None, dtype: str) -> jax.Array:
    """The softmax over the last axis of f32 scores, masked where `seen` is false, in `dtype`.
    Its backward pass keeps only the probabilities as returned (the product with the values
    keeps them anyway): masked scores have probability 0, so their gradient is 0 without the
    mask, and the softmax's own gradient needs nothing else. Autodiff would keep the masked
    scores, their exponentials and the probabilities in f32, and the mask: 15 bytes a score
    where 2 do in bf16."""
    if seen is not None:
        scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def _softmax_forward(scores: jax.Array, seen: jax.Array | None, dtype: str) -> tuple[jax.Array, jax.Array]:
    probs = _softmax(scores, seen, dtype)
    return probs, probs


def _softmax_backward(dtype: str, probs: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, None]:
    p, g = probs.astype(jnp.float32), cotangent.astype(jnp.float32)
    return p * (g - jnp.sum(g * p, -1, keepdims=True)), None


_softmax.defvjp(_softmax_forward, _softmax_backward)


# ---- the online softmax, block by block: flash attention's and ring attention's --------------------

Stats = tuple[jax.Array, jax.Array, jax.Array]


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array | None, cap: float | None = None) -> jax.Array:
    """Scaled scores [b, kv_heads, group, queries, keys] in f32 (capped at cap * tanh(s / cap)
    when `cap` is given), masked ones at the f32 minimum; `mask` is [queries, keys] or
    [b, queries, keys]."""
    return _masked(_capped_scores(q, k, cap), mask)


def _capped_scores(q: jax.Array, k: jax.Array, cap: float | None) -> jax.Array:
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return s if cap is None else cap * jnp.tanh(s / cap)


def _masked(s: jax.Array, mask: jax.Array | None) -> jax.Array:
    if mask is None:
        return s
    # Added as a bias rather than selected against a broadcast minimum: XLA hoists a
    # loop-invariant broadcast out of the layers' scan, and a scores-sized constant would then
    # stay allocated for the whole step. Adding 0 leaves visible scores exact.
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)
    return s + (bias[:, None, None] if bias.ndim == 3 else bias)


def _block_stats(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, cap: float | None = None) -> Stats:
    s = _scores(q, k, mask, cap)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(-1), acc


def _merge_stats(a: Stats, b: Stats) -> Stats:
    """The online softmax: two partial results over disjoint keys, as one."""
    (ma, la, acc_a), (mb, lb, acc_b) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, acc_a * ca[..., None] + acc_b * cb[..., None]


def _finish(stats: Stats, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The output [b, q, kv_heads, group, head_dim] and the log-sum-exp of each query row."""
    m, denominator, acc = stats
    return jnp.einsum("bkgqd->bqkgd", acc / denominator[..., None]).astype(dtype), m + jnp.log(denominator)


def _block_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    mask: jax.Array | None,
    cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv (f32) of one query block against one key/value block, the probabilities
    recomputed from the saved log-sum-exp; delta is rowsum(dout * out)."""
    s = _capped_scores(q, k, cap)
    p = jnp.exp(_masked(s, mask) - lse[..., None])
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(q.dtype), dout, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dout, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * q.shape[-1] ** -0.5
    if cap is not None:
        # Through the cap: d(cap tanh(u / cap))/du = 1 - tanh^2, tanh the capped score over
        # the cap (taken before the mask's bias, which would make it overflow).
        t = s / cap
        ds = ds * (1 - t * t)
    ds = ds.astype(q.dtype)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _delta(out: jax.Array, dout: jax.Array) -> jax.Array:
    """rowsum(dout * out) per query row [b, kv_heads, group, q], in f32."""
    return jnp.einsum("bqkgd,bqkgd->bkgq", out.astype(jnp.float32), dout.astype(jnp.float32))


# ---- the flash core: one device, block by block ----------------------------------------------------


def flash_core(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    segments: jax.Array | None = None,
    *,
    mask: Mask,
    block: int,
    softcap: float | None = None,
) -> jax.Array:
    """The flash algorithm, by the fastest implementation this backend has for the case:
    cuDNN's fused kernel on NVIDIA GPUs, splash attention on TPUs, `flash_attention`
    otherwise (`flash_implementation` says which and why)."""
    implementation, _ = flash_implementation(
        jax.default_backend(),
        queries.dtype.name,
        queries.shape[-1],
        queries.shape[1],
        segments is not None,
        softcap is not None,
    )
    if implementation == "cudnn":
        return cudnn_attention(queries, keys, values, mask=mask)
    if implementation == "splash":
        return splash_attention(queries, keys, values, segments, mask=mask, softcap=softcap)
    return flash_attention(queries, keys, values, segments, mask=mask, block=block, softcap=softcap)


def flash_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    segments: jax.Array | None = None,
    *,
    mask: Mask,
    block: int,
    softcap: float | None = None,
) -> jax.Array:
    """The flash algorithm in plain JAX: query blocks of `block` tokens, each merging the
    key blocks it sees one at a time (fully masked ones skipped), so that at most one block
    of scores exists at once; the backward pass recomputes them from the output and the
    log-sum-exp (`_flash_backward`)."""

    @jax.custom_vjp
    def core(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
        return _flash_forward(q, k, v, segments, mask, block, softcap)[0]

    def forward(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> tuple[jax.Array, tuple]:
        out, lse = _flash_forward(q, k, v, segments, mask, block, softcap)
        return out, (q, k, v, segments, out, lse)

    def backward(saved: tuple, dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, None]:
        q, k, v, segments, out, lse = saved
        return (*_flash_backward(q, k, v, segments, out, lse, dout, mask, block, softcap), None)

    core.defvjp(forward, backward)
    return core(queries, keys, values, segments)


def _block(x: jax.Array, i: jax.Array, block: int) -> jax.Array:
    """Block i of the tokens (axis 1) of x."""
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    mask: Mask,
    block: int,
    cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The output and the log-sum-exp [b, kv_heads, group, s] of every query row."""
    s = q.shape[1]
    blocks = s // block

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        qi, at = _block(q, i, block), i * block + jnp.arange(block)

        def visit(j: jax.Array, stats: Stats) -> Stats:
            kat = j * block + jnp.arange(block)
            seen = _mask_of(mask, at, kat, segments)
            return _merge_stats(stats, _block_stats(qi, _block(k, j, block), _block(v, j, block), seen, cap))

        # Its own diagonal block first: every query sees itself there, so the running
        # maximum is finite from the start and a fully masked block later adds nothing.
        first, last = mask.key_blocks(i, block, blocks)
        own = _block_stats(qi, _block(k, i, block), _block(v, i, block), _mask_of(mask, at, at, segments), cap)
        stats = lax.fori_loop(first, i, visit, own)
        return _finish(lax.fori_loop(i + 1, last + 1, visit, stats), q.dtype)

    outs, lses = lax.map(query_block, jnp.arange(blocks))
    # [blocks, b, block, ...] back to [b, s, ...]; the log-sum-exp [blocks, b, k, g, block].
    out = jnp.moveaxis(outs, 0, 1).reshape(q.shape)
    lse = jnp.moveaxis(lses, 0, -2).reshape(*lses.shape[1:-1], s)
    return out, lse


def _flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    mask: Mask,
    block: int,
    cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Key block by key block: each gathers its dk and dv over the query blocks that see it,
    adding their dq into one f32 accumulator as it goes."""
    s = q.shape[1]
    blocks = s // block
    delta = _delta(out, dout)

    def key_block(dq: jax.Array, j: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        kj, vj, kat = _block(k, j, block), _block(v, j, block), j * block + jnp.arange(block)

        def visit(i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            dq, dk, dv = carry
            at = i * block + jnp.arange(block)
            rows = lax.dynamic_slice_in_dim(lse, i * block, block, axis=-1)
            drows = lax.dynamic_slice_in_dim(delta, i * block, block, axis=-1)
            seen = _mask_of(mask, at, kat, segments)
            dq_i, dk_i, dv_i = _block_grads(_block(q, i, block), kj, vj, _block(dout, i, block), rows, drows, seen, cap)
            dq = lax.dynamic_update_slice_in_dim(dq, _block(dq, i, block) + dq_i, i * block, axis=1)
            return dq, dk + dk_i, dv + dv_i

        first, last = mask.query_blocks(j, block, blocks)
        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dk, dv = lax.fori_loop(first, last + 1, visit, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dks, dvs) = lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(blocks))
    dk = jnp.moveaxis(dks, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dvs, 0, 1).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- fused kernels --------------------------------------------------------------------------------


def cudnn_attention(queries: jax.Array, keys: jax.Array, values: jax.Array, *, mask: Mask) -> jax.Array:
    """cuDNN's fused flash attention, through `jax.nn.dot_product_attention` (`flash_implementation`
    says when it applies): the query heads of a group follow one another, as jax groups them."""
    b, s, kv, group, d = queries.shape
    window = None if mask.window is None else (mask.window - 1, 0)
    out: jax.Array = jax.nn.dot_product_attention(
        queries.reshape(b, s, kv * group, d),
        keys,
        values,
        is_causal=mask.causal,
        local_window_size=window,
        implementation=CUDNN,
    )
    return out.reshape(queries.shape)


# The implementation `cudnn_attention` asks jax for; tests set it to "xla", which takes the
# same arguments on any backend.
CUDNN: Literal["cudnn", "xla"] = "cudnn"


def splash_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    segments: jax.Array | None = None,
    *,
    mask: Mask,
    softcap: float | None = None,
) -> jax.Array:
    """Pallas splash attention (TPU): a grouped-query kernel per key/value head, vmapped over
    the batch; the queries scaled first (the kernel does not)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    s, group, d = queries.shape[1], queries.shape[3], queries.shape[4]
    one: masks.Mask
    if not mask.causal:
        one = masks.FullMask((s, s))
    elif mask.window is None:
        one = masks.CausalMask((s, s))
    else:
        one = masks.LocalMask((s, s), (mask.window - 1, 0), offset=0)
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([one] * group), interpret=SPLASH_INTERPRET, attn_logits_soft_cap=softcap
    )
    ids = None if segments is None else splash.SegmentIds(segments, segments)

    def one_sequence(q: jax.Array, k: jax.Array, v: jax.Array, ids: splash.SegmentIds | None) -> jax.Array:
        # q [kv, group, s, d], k and v [kv, s, d]: each key/value head with its group of queries.
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(q, k, v)

    q = jnp.einsum("bskgd->bkgsd", queries * d**-0.5)
    k, v = jnp.einsum("bskd->bksd", keys), jnp.einsum("bskd->bksd", values)
    out = jax.vmap(one_sequence)(q, k, v, ids)
    return jnp.einsum("bkgsd->bskgd", out).astype(queries.dtype)


# Tests run splash attention's kernel interpreted on CPU.
SPLASH_INTERPRET = False


# ---- context parallelism: ring attention ----------------------------------------------------------


def ring_attention(
    x: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    o: jax.Array,
    q_bias: jax.Array | None = None,
    k_bias: jax.Array | None = None,
    v_bias: jax.Array | None = None,
    o_bias: jax.Array | None = None,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    norm_eps: float = 1e-6,
    axis: str,
    dtype: str,
) -> jax.Array:
    """`attention` on [batch, seq, dim] with the sequence split over the mesh axis `axis`.

    Each device keeps its own queries and passes its keys and values around the ring of
    `axis` (ring - 1 passes of `lax.ppermute`), merging every block it sees into its rows with
    an online softmax in f32, so no device ever holds the whole sequence. The backward pass
    is a second trip around the ring that carries the key/value gradients with the blocks
    and one pass more to bring them home (see `_ring_backward`).

    Under a causal mask, contiguous pieces would leave the first device idle most of the
    time; so the sequence is cut into 2 * ring chunks and device i works on chunks i and
    2 * ring - 1 - i (the zig-zag layout), which makes every block it receives from another
    device exactly half visible. The tokens are moved into that layout on the way in and back
    to their order on the way out, so the result is `attention`'s, token for token.

    Runs under jit with a mesh set (`jax.set_mesh`); `axis` is manual inside, every other axis
    stays automatic, so heads split over a tensor-parallel axis stay split. On an axis of one
    device it is `attention` itself.
    """
    if _axis_size(axis) == 1:
        # A ring of one device is plain attention (and XLA's partitioner rejects a manual
        # axis of one device next to automatic ones).
        extra = (q_bias, k_bias, v_bias, o_bias, q_norm, k_norm)
        return attention(
            x,
            q,
            k,
            v,
            o,
            *extra,
            heads=heads,
            kv_heads=kv_heads,
            causal=causal,
            rope=rope,
            norm_eps=norm_eps,
            dtype=dtype,
        )
    tokens, whole = PartitionSpec(None, axis, None), PartitionSpec()
    shard = functools.partial(
        _ring_attention_shard,
        heads=heads,
        kv_heads=kv_heads,
        causal=causal,
        rope=rope,
        norm_eps=norm_eps,
        axis=axis,
        dtype=dtype,
    )
    # The weights enter in f32 (see `_ring_attention_shard`); the casts are exact.
    given = {"q": q, "k": k, "v": v, "o": o, "q_bias": q_bias, "k_bias": k_bias, "v_bias": v_bias, "o_bias": o_bias}
    given |= {"q_norm": q_norm, "k_norm": k_norm}
    weights: dict[str, jax.Array] = {name: w.astype(jnp.float32) for name, w in given.items() if w is not None}
    return jax.shard_map(shard, in_specs=(tokens, whole), out_specs=tokens, axis_names={axis})(x, weights)


def _axis_size(axis: str) -> int:
    """Devices along a mesh axis of the mesh set with `jax.set_mesh`."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis not in mesh.axis_names:
        raise ValueError(f"ring attention over `{axis}` needs the mesh: call it under `jax.set_mesh(mesh)`")
    return int(mesh.shape[axis])


def _ring_attention_shard(
    x: jax.Array,
    weights: dict[str, jax.Array],
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    norm_eps: float = 1e-6,
    axis: str,
    dtype: str,
) -> jax.Array:
    """One device's share of `ring_attention`: its tokens, all of the weights (in f32)."""
    b, n, _ = x.shape
    ring, me = lax.axis_size(axis), lax.axis_index(axis)
    # Each device's weight gradient is summed over `axis` where the weights become per-device
    # values: made so here, in f32, that sum runs in f32, which is more accurate and avoids a
    # crash of XLA's CPU compiler on a bf16 sum there ("Invalid binary instruction opcode
    # copy", jax 0.10.2, whenever another mesh axis stays automatic).
    w = {name: lax.pcast(value, (axis,), to="varying").astype(dtype) for name, value in weights.items()}
    # The tokens move into the zig-zag layout once, as the layer's input (one tensor rather
    # than q, k and v); every step before the ring works token by token, so it may run on
    # the zig-zagged tokens.
    x = x.astype(dtype)
    if causal:
        x = _zigzag(x, axis, ring)
    queries, keys, values = (
        _heads(x, w[n], w.get(f"{n}_bias"), c) for n, c in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    )
    queries, keys = _head_norm(queries, w.get("q_norm"), norm_eps), _head_norm(keys, w.get("k_norm"), norm_eps)
    head_dim = queries.shape[-1]
    if rope is not None:
        positions = _ring_positions(me, n, ring, causal)
        queries, keys = rope(queries, positions), rope(keys, positions)
    queries = queries.reshape(b, n, kv_heads, heads // kv_heads, head_dim)
    out = _ring_core(queries, keys, values, axis=axis, causal=causal).reshape(b, n, heads * head_dim)
    if causal:
        # Back to token order before the output projection, while the heads are still split
        # over a tensor-parallel axis (fewer bytes than the projected, unsplit output).
        out = _zigzag(out, axis, ring, inverse=True)
    return _project_out(out, w["o"], w.get("o_bias"))


def _ring_positions(me: jax.Array, n: int, ring: int, causal: bool) -> jax.Array:
    """Where device `me`'s n tokens sit in the whole sequence (zig-zag chunks when causal)."""
    if not causal:
        return me * n + jnp.arange(n)
    c = n // 2
    return jnp.concatenate([me * c + jnp.arange(c), (2 * ring - 1 - me) * c + jnp.arange(c)])


def _zigzag(x: jax.Array, axis: str, ring: int, *, inverse: bool = False) -> jax.Array:
    """Move tokens [b, n, ...] between the contiguous layout (device i holds chunks 2i and
    2i + 1 of 2 * ring) and the zig-zag one (chunks i and 2 * ring - 1 - i), or back.

    Even chunks go to distinct devices, and so do odd ones, so each direction is two
    `ppermute`s; a device holding chunk c in the zig-zag layout finds it first when c < ring.
    """

    def owner(chunk: int) -> int:
        return chunk if chunk < ring else 2 * ring - 1 - chunk

    to_even = [(i, owner(2 * i)) for i in range(ring)]
    to_odd = [(i, owner(2 * i + 1)) for i in range(ring)]
    first, second = jnp.split(x, 2, axis=1)
    # In the zig-zag layout device i's first chunk, i, is even exactly when i is.
    even_first = lax.axis_index(axis) % 2 == 0
    if inverse:
        even = lax.ppermute(jnp.where(even_first, first, second), axis, [(t, s) for s, t in to_even])
        odd = lax.ppermute(jnp.where(even_first, second, first), axis, [(t, s) for s, t in to_odd])
        return jnp.concatenate([even, odd], axis=1)
    even, odd = lax.ppermute(first, axis, to_even), lax.ppermute(second, axis, to_odd)
    return jnp.concatenate([jnp.where(even_first, even, odd), jnp.where(even_first, odd, even)], axis=1)


def _ring_core(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, causal: bool) -> jax.Array:
    """Attention of this device's queries over every device's keys and values, with the
    hand-written ring backward: autodiff through the loop would keep every received block
    and every block's probabilities, which is what splitting the sequence is meant to avoid."""

    @jax.custom_vjp
    def core(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _ring_forward(q, k, v, axis, causal)[0]

    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        out, lse = _ring_forward(q, k, v, axis, causal)
        return out, (q, k, v, out, lse)

    def backward(saved: tuple[jax.Array, ...], dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v, out, lse = saved
        return _ring_backward(q, k, v, out, lse, dout, axis, causal)

    core.defvjp(forward, backward)
    return core(q, k, v)


def _visit(
    q: jax.Array, kv: tuple[jax.Array, jax.Array], stats: Stats, src: jax.Array, me: jax.Array, causal: bool
) -> Stats:
    """Merge the key/value block of device `src` into device `me`'s rows (src != me)."""
    k, v = kv
    if not causal:
        return _merge_stats(stats, _block_stats(q, k, v, None))
    # Zig-zag: chunk `src` precedes both of mine and chunk 2 * ring - 1 - src follows both
    # when src < me; when src > me, my first chunk precedes both of its chunks and my second
    # follows them. Either way half the block is wholly visible and the rest wholly masked,
    # so only the visible half is computed, on every device alike.
    c = q.shape[1] // 2

    def earlier(stats: Stats) -> Stats:  # all my queries, its first chunk of keys
        return _merge_stats(stats, _block_stats(q, k[:, :c], v[:, :c], None))

    def later(stats: Stats) -> Stats:  # my second chunk of queries, all its keys
        head = jax.tree.map(lambda t: t[:, :, :, :c], stats)
        tail = _merge_stats(jax.tree.map(lambda t: t[:, :, :, c:], stats), _block_stats(q[:, c:], k, v, None))
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=3), head, tail)

    return lax.cond(src < me, earlier, later, stats)


def _ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, causal: bool) -> tuple[jax.Array, jax.Array]:
    """The output [b, n, kv_heads, group, head_dim] and its log-sum-exp per query row (f32)."""
    ring, me = lax.axis_size(axis), lax.axis_index(axis)
    right = [(i, (i + 1) % ring) for i in range(ring)]
    # This device's own block first: under a causal mask every query sees at least itself
    # there, so the running maximum is finite from the start.
    stats = _block_stats(q, k, v, _ring_diagonal_mask(q.shape[1]) if causal else None)
    # Block t comes from device me - t; the pass for block t + 1 is issued before block t is
    # used, so the transfer can overlap the work (ring - 1 passes in all).
    Carry = tuple[tuple[jax.Array, jax.Array], Stats]

    def step(t: jax.Array, carry: Carry) -> Carry:
        kv, stats = carry
        following = lax.ppermute(kv, axis, right)
        return following, _visit(q, kv, stats, (me - t) % ring, me, causal)

    kv, stats = lax.fori_loop(1, ring - 1, step, (lax.ppermute((k, v), axis, right), stats))
    return _finish(_visit(q, kv, stats, (me + 1) % ring, me, causal), q.dtype)


def _ring_diagonal_mask(n: int) -> jax.Array:
    """The causal mask of a device's own block: its tokens are in order, chunk by chunk."""
    return jnp.tril(jnp.ones((n, n), dtype=bool))


def _visit_grads(
    q: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    src: jax.Array,
    me: jax.Array,
    causal: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_visit`'s gradients: dq for my rows, dk and dv for the visiting block."""
    k, v = kv
    if not causal:
        return _block_grads(q, k, v, dout, lse, delta, None)
    c = q.shape[1] // 2

    def earlier() -> tuple[jax.Array, jax.Array, jax.Array]:
        dq, dk, dv = _block_grads(q, k[:, :c], v[:, :c], dout, lse, delta, None)
        return dq, jnp.concatenate([dk, jnp.zeros_like(dk)], 1), jnp.concatenate([dv, jnp.zeros_like(dv)], 1)

    def later() -> tuple[jax.Array, jax.Array, jax.Array]:
        dq, dk, dv = _block_grads(q[:, c:], k, v, dout[:, c:], lse[..., c:], delta[..., c:], None)
        return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

    return lax.cond(src < me, earlier, later)


def _ring_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    axis: str,
    causal: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The second trip: the key/value blocks go round again, each carrying its gradient
    accumulators (f32), which every device adds to; after ring - 1 passes a device holds the
    accumulators of its right neighbour's block, so one last pass delivers them."""
    ring, me = lax.axis_size(axis), lax.axis_index(axis)
    right = [(i, (i + 1) % ring) for i in range(ring)]
    delta = _delta(out, dout)
    dq, dk, dv = _block_grads(q, k, v, dout, lse, delta, _ring_diagonal_mask(q.shape[1]) if causal else None)

    def step(t: jax.Array, carry: tuple[jax.Array, tuple[jax.Array, ...]]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        dq, travelling = carry
        kb, vb, dkb, dvb = lax.ppermute(travelling, axis, right)
        dq_t, dk_t, dv_t = _visit_grads(q, (kb, vb), dout, lse, delta, (me - t) % ring, me, causal)
        return dq + dq_t, (kb, vb, dkb + dk_t, dvb + dv_t)

    dq, (_, _, dk, dv) = lax.fori_loop(1, ring, step, (dq, (k, v, dk, dv)))
    dk, dv = lax.ppermute((dk, dv), axis, right)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
