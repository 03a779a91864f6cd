"""One function per layer kind, on global (logical) arrays.

Conventions, shared by every kernel so that both backends can call them the same way:
the input activation is the first argument; weights follow as keyword arguments named as
the layer rule names them (already cast to the compute dtype); then the layer's static
arguments, keyword-only; `dtype` is the compute dtype's name. Sharding is not a kernel's
business: the caller pins inputs and outputs to the shardings the checker gave them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

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


# ---- attention -----------------------------------------------------------------------------------


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
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    dtype: str,
    recompute_core: bool = False,
) -> jax.Array:
    """Self-attention on [batch, seq, dim]; grouped-query when kv_heads < heads. Each
    projection adds its bias when it has one. `rope(t, positions)` (`rotary`, its base bound)
    encodes the tokens' places in the sequence into the queries and the keys. With
    `recompute_core` the core is checkpointed: the backward pass reruns its scores and
    softmax from the kept queries and keys rather than keeping its [batch, heads, seq, seq]
    intermediates (Korthikanti et al.'s selective recomputation)."""
    b, s, _ = x.shape
    h = x.astype(dtype)
    queries, keys, values = _heads(h, q, q_bias, heads), _heads(h, k, k_bias, kv_heads), _heads(h, v, v_bias, kv_heads)
    head_dim = queries.shape[-1]
    if rope is not None:
        positions = jnp.arange(s)
        queries, keys = rope(queries, positions), rope(keys, positions)
    # Grouped-query: the query heads form kv_heads groups, each sharing one key/value head.
    queries = queries.reshape(b, s, kv_heads, heads // kv_heads, head_dim)
    core = functools.partial(_attention_core, causal=causal, dtype=dtype)
    out = (jax.checkpoint(core) if recompute_core else core)(queries, keys, values)
    return _project_out(out.reshape(b, s, heads * head_dim), o, o_bias)


def _attention_core(queries: jax.Array, keys: jax.Array, values: jax.Array, *, causal: bool, dtype: str) -> jax.Array:
    """Softmax(q·kᵀ/sqrt(d))·v of queries [b, s, kv_heads, group, head_dim] and keys and
    values [b, s, kv_heads, head_dim]; scores and softmax in f32."""
    s, head_dim = queries.shape[1], queries.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", queries, keys).astype(jnp.float32) * head_dim**-0.5
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, values)


def _heads(x: jax.Array, w: jax.Array, bias: jax.Array | None, n: int) -> jax.Array:
    """x [b, s, dim] projected by w (and its bias) into n heads: [b, s, n, head_dim]."""
    y = jnp.einsum("bsd,de->bse", x, w)
    return (y if bias is None else y + bias).reshape(*x.shape[:2], n, w.shape[-1] // n)


def _project_out(heads_out: jax.Array, o: jax.Array, o_bias: jax.Array | None) -> jax.Array:
    y = jnp.einsum("bse,ed->bsd", heads_out, o)
    return y if o_bias is None else y + o_bias


def rotary(t: jax.Array, positions: jax.Array, *, base: float) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (rotate-half layout);
    `positions` are the tokens' places in the whole sequence."""
    half = t.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    t1, t2 = t[..., :half].astype(jnp.float32), t[..., half:].astype(jnp.float32)
    return jnp.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos], axis=-1).astype(t.dtype)


# ---- context parallelism: ring attention ----------------------------------------------------------
#
# Inside the ring the arrays are one device's tokens: queries [b, n, kv_heads, group, head_dim]
# (n = seq / ring), keys and values [b, n, kv_heads, head_dim]. Softmax statistics are kept per
# query row in f32: the running maximum and the denominator [b, kv_heads, group, n], and the
# unnormalised output acc [b, kv_heads, group, n, head_dim].

RingStats = tuple[jax.Array, jax.Array, jax.Array]


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
    *,
    heads: int,
    kv_heads: int,
    causal: bool,
    rope: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
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
        return attention(
            x,
            q,
            k,
            v,
            o,
            q_bias,
            k_bias,
            v_bias,
            o_bias,
            heads=heads,
            kv_heads=kv_heads,
            causal=causal,
            rope=rope,
            dtype=dtype,
        )
    tokens, whole = PartitionSpec(None, axis, None), PartitionSpec()
    shard = functools.partial(
        _ring_attention_shard,
        heads=heads,
        kv_heads=kv_heads,
        causal=causal,
        rope=rope,
        axis=axis,
        dtype=dtype,
    )
    # The weights enter in f32 (see `_ring_attention_shard`); the casts are exact.
    given = {"q": q, "k": k, "v": v, "o": o, "q_bias": q_bias, "k_bias": k_bias, "v_bias": v_bias, "o_bias": o_bias}
    weights = {name: w.astype(jnp.float32) for name, w in given.items() if w is not None}
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


def _ring_scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scaled scores [b, kv_heads, group, queries, keys] in f32, masked ones at the f32 minimum."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    if mask is None:
        return s
    # Added as a [queries, keys] bias rather than selected against a broadcast minimum: XLA
    # hoists a loop-invariant broadcast out of the layers' scan, and a scores-sized constant
    # would then stay allocated for the whole step. Adding 0 leaves visible scores exact.
    return s + jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min)


def _block_stats(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> RingStats:
    s = _ring_scores(q, k, mask)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(-1), acc


def _merge_stats(a: RingStats, b: RingStats) -> RingStats:
    """The online softmax: two partial results over disjoint keys, as one."""
    (ma, la, acc_a), (mb, lb, acc_b) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, acc_a * ca[..., None] + acc_b * cb[..., None]


def _visit(
    q: jax.Array, kv: tuple[jax.Array, jax.Array], stats: RingStats, src: jax.Array, me: jax.Array, causal: bool
) -> RingStats:
    """Merge the key/value block of device `src` into device `me`'s rows (src != me)."""
    k, v = kv
    if not causal:
        return _merge_stats(stats, _block_stats(q, k, v, None))
    # Zig-zag: chunk `src` precedes both of mine and chunk 2 * ring - 1 - src follows both
    # when src < me; when src > me, my first chunk precedes both of its chunks and my second
    # follows them. Either way half the block is wholly visible and the rest wholly masked,
    # so only the visible half is computed, on every device alike.
    c = q.shape[1] // 2

    def earlier(stats: RingStats) -> RingStats:  # all my queries, its first chunk of keys
        return _merge_stats(stats, _block_stats(q, k[:, :c], v[:, :c], None))

    def later(stats: RingStats) -> RingStats:  # my second chunk of queries, all its keys
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
    Carry = tuple[tuple[jax.Array, jax.Array], RingStats]

    def step(t: jax.Array, carry: Carry) -> Carry:
        kv, stats = carry
        following = lax.ppermute(kv, axis, right)
        return following, _visit(q, kv, stats, (me - t) % ring, me, causal)

    kv, stats = lax.fori_loop(1, ring - 1, step, (lax.ppermute((k, v), axis, right), stats))
    m, denominator, acc = _visit(q, kv, stats, (me + 1) % ring, me, causal)
    out = jnp.einsum("bkgqd->bqkgd", acc / denominator[..., None]).astype(q.dtype)
    return out, m + jnp.log(denominator)


def _ring_diagonal_mask(n: int) -> jax.Array:
    """The causal mask of a device's own block: its tokens are in order, chunk by chunk."""
    return jnp.tril(jnp.ones((n, n), dtype=bool))


def _block_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv (f32) of one query block against one key/value block, the probabilities
    recomputed from the saved log-sum-exp; delta is rowsum(dout * out)."""
    p = jnp.exp(_ring_scores(q, k, mask) - lse[..., None])
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(q.dtype), dout, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dout, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * q.shape[-1] ** -0.5).astype(q.dtype)
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


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
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", out.astype(jnp.float32), dout.astype(jnp.float32))
    dq, dk, dv = _block_grads(q, k, v, dout, lse, delta, _ring_diagonal_mask(q.shape[1]) if causal else None)

    def step(t: jax.Array, carry: tuple[jax.Array, tuple[jax.Array, ...]]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        dq, travelling = carry
        kb, vb, dkb, dvb = lax.ppermute(travelling, axis, right)
        dq_t, dk_t, dv_t = _visit_grads(q, (kb, vb), dout, lse, delta, (me - t) % ring, me, causal)
        return dq + dq_t, (kb, vb, dkb + dk_t, dvb + dv_t)

    dq, (_, _, dk, dv) = lax.fori_loop(1, ring, step, (dq, (k, v, dk, dv)))
    dk, dv = lax.ppermute((dk, dv), axis, right)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- mixture of experts --------------------------------------------------------------------------
#
# GShard-style routing. A routing group is one sequence: one row of the batch, every position of
# it (a [batch, features] input makes each example a group of one token). Groups are routed
# independently, so the result does not depend on the mesh, the microbatches or the gradient
# accumulation slices a batch is cut into. Inside a group every token picks its top_k experts;
# each expert has `slots` places per group, taken first by every token's first choice in token
# order, then by the second choices, and so on; a choice that finds its expert full is dropped
# (it adds nothing; the residual path around the layer carries the token). Dispatch and combine
# are one-hot tensors [groups, tokens, experts, slots].

# The key of the auxiliary value every layer's aux dict may hold that is added to the loss.
AUX_LOSS = "aux_loss"


def add_aux(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two sets of layers' auxiliary values as one: sums key by key."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


# A mixture of experts' output and its auxiliary values.
MoEResult = tuple[jax.Array, dict[str, jax.Array]]


def moe(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int,
    capacity: float,
    aux_weight: float,
    expert_axes: tuple[str, ...],
    token_axes: tuple[str, ...],
    dtype: str,
) -> MoEResult:
    """Top-k routed GELU MLP experts on [batch, ..., dim], with capacity and dropped tokens.

    Returns the output and the layer's auxiliary values (f32 scalars): `aux_loss`, the
    load-balancing loss times `aux_weight`, to be added to the training loss;
    `moe_dropped` and `moe_routed`, the token-to-expert choices that found their expert full
    and all choices made (counts, summed over the batch).

    Each expert has ceil(capacity * tokens * top_k / experts) slots per group (at most
    `tokens`), `capacity` being the capacity factor. Gates are the router's softmax (f32)
    renormalised over the chosen k; a dropped choice keeps its share of the gate, so its
    token's expert output shrinks rather than being reweighted. The load-balancing loss is
    Switch Transformer's, per group and averaged over groups: experts * sum_e(f_e * p_e), f_e
    the share of the group's choices (before dropping) that went to expert e, p_e the mean
    router probability of e; it is 1 when routing is perfectly even.

    `expert_axes` are the mesh axes splitting the experts (w_in[ep, _, _]); `token_axes`
    those splitting the batch. With experts split, the layer runs in `jax.shard_map`, manual
    over both (every other axis stays automatic): where the experts' axes also split the
    batch, each device routes its own sequences and `lax.all_to_all` carries every expert's
    slots to the device that holds it and the results back; where the tokens are whole
    along the experts' axes, every device routes the same tokens, fills only its own
    experts' slots and one `psum` adds the experts' contributions together. Inside another
    `shard_map` (a pipeline stage) its backward pass recomputes its forward first
    (`_shard_map_with_inner_vjp`).
    """
    route = functools.partial(_moe_groups, top_k=top_k, capacity=capacity, aux_weight=aux_weight, dtype=dtype)
    experts = _split_axes(expert_axes)
    if not experts:
        # Every expert on every device: plain arrays; XLA splits the groups over the batch axes.
        return route(x, router, w_in, w_out, exchange="local", expert_axes=(), stats_axes=())
    tokens = _split_axes(token_axes)
    rows = PartitionSpec(tokens or None)
    split_experts = PartitionSpec(experts)
    exchange = "all_to_all" if set(experts) <= set(tokens) else "psum"
    nested = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside the pipeline's shard_map
    shard_map = _shard_map_with_inner_vjp if nested else jax.shard_map
    return shard_map(
        functools.partial(route, exchange=exchange, expert_axes=experts, stats_axes=tokens),
        in_specs=(rows, PartitionSpec(), split_experts, split_experts),
        out_specs=(rows, PartitionSpec()),
        axis_names=frozenset({*tokens, *experts}),
    )(x, router, w_in, w_out)


def _shard_map_with_inner_vjp(
    body: functools.partial[MoEResult],
    *,
    in_specs: tuple[PartitionSpec, ...],
    out_specs: tuple[PartitionSpec, PartitionSpec],
    axis_names: frozenset[str],
) -> jax.custom_vjp[MoEResult]:
    """`jax.shard_map(body, ...)` whose backward pass is a second `shard_map` running
    `jax.vjp(body)` on each device, recomputing the body's forward there.

    Differentiating a `shard_map` directly splits it into a forward that returns its
    residuals and a backward that takes them; nested in another `shard_map` (the pipeline's,
    manual over the stage axis) jax 0.10.2 gives those residuals shapes that disagree with
    their shardings ("'sdy.manual_computation' op result shape, corresponding sharding, and
    region result shape ... must match"), and lowering fails. Saving only the inputs avoids
    that, at the price of the forward computed (and its collectives sent) once more.
    """
    forward = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names)

    def pullback(args: tuple[jax.Array, ...], cotangent: MoEResult) -> tuple[jax.Array, ...]:
        return jax.vjp(body, *args)[1](cotangent)

    backward = jax.shard_map(pullback, in_specs=(in_specs, out_specs), out_specs=in_specs, axis_names=axis_names)

    @jax.custom_vjp
    def run(*args: jax.Array) -> MoEResult:
        return forward(*args)

    run.defvjp(lambda *args: (forward(*args), args), backward)
    return run


def _split_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes among `axes` of more than one device, on the mesh set with `jax.set_mesh`
    (XLA's partitioner rejects a manual axis of one device next to automatic ones), less
    those an enclosing `shard_map` made manual already (data parallelism's: the tokens
    here are this device's rows)."""
    if not axes:
        return ()
    mesh = jax.sharding.get_abstract_mesh()
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"mixture of experts over {missing} needs the mesh: call it under `jax.set_mesh(mesh)`")
    return tuple(a for a in axes if mesh.shape[a] > 1 and a not in mesh.manual_axes)


def _moe_groups(
    x: jax.Array,
    router: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    *,
    top_k: int,
    capacity: float,
    aux_weight: float,
    dtype: str,
    exchange: str,
    expert_axes: tuple[str, ...],
    stats_axes: tuple[str, ...],
) -> MoEResult:
    """`moe` on the groups at hand (one device's, inside `shard_map`). `exchange` says how
    the slots reach the experts: "local" (all experts are here), "all_to_all" or "psum" over
    `expert_axes`; `stats_axes` are the manual axes the groups are split over."""
    shape = x.shape
    x = x.astype(dtype).reshape(shape[0], -1, shape[-1])  # [groups, tokens, dim]
    dispatch, combine, stats = _route(x, router, top_k=top_k, capacity=capacity)
    if exchange == "psum":
        # The tokens are whole here, and so are the routing tables: keep this device's experts.
        mine = w_in.shape[0]
        first = lax.axis_index(expert_axes) * mine
        dispatch = lax.dynamic_slice_in_dim(dispatch, first, mine, axis=2)
        combine = lax.dynamic_slice_in_dim(combine, first, mine, axis=2)
    slots = jnp.einsum("gsec,gsd->gecd", dispatch.astype(dtype), x)  # [groups, experts, slots, dim]
    if exchange == "all_to_all":
        # Expert e's slots of every group go to the device holding e; the groups of all the
        # devices along the axes arrive stacked, [devices * groups, experts here, slots, dim].
        slots = lax.all_to_all(slots, expert_axes, 1, 0, tiled=True)
    hidden = jax.nn.gelu(jnp.einsum("gecd,edf->gecf", slots, w_in), approximate=True)
    out = jnp.einsum("gecf,efd->gecd", hidden, w_out)
    if exchange == "all_to_all":
        out = lax.all_to_all(out, expert_axes, 0, 1, tiled=True)
    y = jnp.einsum("gsec,gecd->gsd", combine.astype(dtype), out)
    if exchange == "psum":
        y = lax.psum(y, expert_axes)
    if stats_axes:
        # Every device holds as many groups: the mean over groups is the mean of the means.
        # (`moe_routed` is the same on every device: its psum is it times their number.)
        stats = {
            AUX_LOSS: lax.pmean(stats[AUX_LOSS], stats_axes),
            "moe_dropped": lax.psum(stats["moe_dropped"], stats_axes),
            "moe_routed": lax.psum(stats["moe_routed"], stats_axes),
        }
    return y.reshape(shape), {**stats, AUX_LOSS: aux_weight * stats[AUX_LOSS]}


def _route(
    x: jax.Array, router: jax.Array, *, top_k: int, capacity: float
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The routing of groups x [groups, tokens, dim]: the one-hot dispatch tensor and the
    gate-weighted combine tensor [groups, tokens, experts, slots] (f32), and the load-balancing
    loss (unweighted, mean over the groups) with the dropped and routed choice counts."""
    groups, tokens, _ = x.shape
    experts = router.shape[-1]
    slots = min(tokens, math.ceil(capacity * tokens * top_k / experts))
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, router).astype(jnp.float32), axis=-1)
    top, chosen = lax.top_k(probs, top_k)  # [groups, tokens, k]
    gates = top / top.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [groups, tokens, k, experts]
    # Slots are taken choice by choice (all first choices, then all second ones), in token
    # order within each: a running count per expert over that order is each choice's slot.
    order = choice.transpose(0, 2, 1, 3).reshape(groups, top_k * tokens, experts)
    taken = (jnp.cumsum(order, axis=1) - 1) * order
    slot = taken.reshape(groups, top_k, tokens, experts).transpose(0, 2, 1, 3).sum(-1)  # [groups, tokens, k]
    # A slot past the last is a dropped choice: its one-hot row is all zeros.
    in_slot = jax.nn.one_hot(slot, slots, dtype=jnp.float32)  # [groups, tokens, k, slots]
    dispatch = jnp.einsum("gske,gskc->gsec", choice.astype(jnp.float32), in_slot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, choice.astype(jnp.float32), in_slot)
    share = choice.sum((1, 2)).astype(jnp.float32) / (tokens * top_k)  # f_e per group
    balance = experts * jnp.sum(share * probs.mean(1), axis=-1)
    dropped = jnp.sum(slot >= slots).astype(jnp.float32)
    routed = jnp.asarray(groups * tokens * top_k, jnp.float32)
    return dispatch, combine, {AUX_LOSS: balance.mean(), "moe_dropped": dropped, "moe_routed": routed}


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
