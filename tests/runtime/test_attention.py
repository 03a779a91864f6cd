"""Attention's cores (dslc/runtime/attention.py): the flash algorithm, in plain JAX and as each
fused kernel is called, computes what the dense core computes, forward and backward, under
every mask; and keeps what a fused kernel keeps.

Tolerances: f32 throughout, 2e-5 of each array's largest value. The blockwise core adds its
key blocks in another order than one softmax over the whole row (an online softmax rescales
each partial sum as it goes): measured 1e-7 to 1.4e-6 on these shapes, forward and gradients.
A mistake in a mask or a block's bounds moves a row by the weight of a whole key (1e-2 and
more).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dslc.runtime import attention as A
from dslc.runtime.fused import flash_implementation

TOL = 2e-5
B, S, KV, GROUP, D = 2, 64, 2, 3, 16


def arrays(seq: int = S, d: int = D, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, seq, KV, GROUP, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, seq, KV, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, seq, KV, d)), jnp.float32)
    # Documents of random lengths packed one after another, ids rising along each row.
    docs = jnp.asarray(np.sort(rng.integers(0, 4, (B, seq)), axis=1), jnp.int32)
    return q, k, v, docs


def relative(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.abs(got - want).max() / jnp.abs(want).max())


def value_and_grads(core: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> list[jax.Array]:
    """The core's output and the gradients of a loss of it with respect to q, k and v."""
    cotangent = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    out, pull = jax.vjp(core, q, k, v)
    return [out, *pull(cotangent)]


MASKS = [
    pytest.param(True, None, False, 16, id="causal"),
    pytest.param(False, None, False, 16, id="full"),
    pytest.param(True, 20, False, 16, id="window-across-blocks"),
    pytest.param(True, 7, False, 8, id="window-inside-a-block"),
    pytest.param(True, None, True, 16, id="causal-documents"),
    pytest.param(True, 9, True, 8, id="window-documents"),
    pytest.param(False, None, True, 32, id="full-documents"),
    pytest.param(True, None, False, 64, id="one-block"),
]


@pytest.mark.parametrize(("causal", "window", "documents", "block"), MASKS)
def test_the_blockwise_core_is_the_dense_core(causal: bool, window: int | None, documents: bool, block: int) -> None:
    q, k, v, docs = arrays()
    segments = docs if documents else None
    mask = A.Mask(causal, window)
    want = value_and_grads(lambda q, k, v: A.dense_core(q, k, v, segments, mask=mask), q, k, v)
    flash = jax.jit(lambda q, k, v: A.flash_attention(q, k, v, segments, mask=mask, block=block))
    got = value_and_grads(flash, q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative(g, w) <= TOL, name


def test_masks_hide_what_they_say() -> None:
    """The dense core itself, against rows computed one query at a time from the definition."""
    q, k, v, docs = arrays(seq=12)
    mask = A.Mask(True, 4)
    out = np.asarray(A.dense_core(q, k, v, docs, mask=mask))
    qn, kn, vn, dn = (np.asarray(a, np.float64) for a in (q, k, v, docs))
    for b in range(B):
        for i in range(12):
            seen = [j for j in range(12) if i - 4 < j <= i and dn[b, j] == dn[b, i]]
            scores = np.einsum("kgd,jkd->kgj", qn[b, i], kn[b, seen]) / np.sqrt(D)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            row = np.einsum("kgj,jkd->kgd", p / p.sum(-1, keepdims=True), vn[b, seen])
            np.testing.assert_allclose(out[b, i], row, rtol=1e-5, atol=1e-5)


def test_positions_restart_at_each_document() -> None:
    docs = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    assert A.document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("window", [None, 10])
def test_the_cudnn_call_takes_the_cores_arguments(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's kernel is called through `jax.nn.dot_product_attention`, whose XLA
    implementation takes the same arguments anywhere: the head grouping and the window's
    bounds as the dense core reads them."""
    monkeypatch.setattr(A, "CUDNN", "xla")
    q, k, v, _ = arrays()
    mask = A.Mask(True, window)
    want = value_and_grads(lambda q, k, v: A.dense_core(q, k, v, mask=mask), q, k, v)
    got = value_and_grads(lambda q, k, v: A.cudnn_attention(q, k, v, mask=mask), q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative(g, w) <= TOL, name


@pytest.mark.parametrize(
    ("causal", "window", "documents"), [(True, None, False), (True, 40, False), (True, None, True)]
)
def test_splash_attention_interpreted_is_the_dense_core(
    causal: bool, window: int | None, documents: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pallas splash attention, its TPU kernel interpreted on the CPU (slowly: one sequence
    of 128 tokens), forward only; its backward is the kernel's own."""
    monkeypatch.setattr(A, "SPLASH_INTERPRET", True)
    q, k, v, docs = arrays(seq=128, d=64)
    q, k, v, docs = q[:1], k[:1], v[:1], docs[:1]
    segments = docs if documents else None
    mask = A.Mask(causal, window)
    want = A.dense_core(q, k, v, segments, mask=mask)
    assert relative(A.splash_attention(q, k, v, segments, mask=mask), want) <= TOL


@pytest.mark.parametrize(
    ("backend", "dtype", "head_dim", "seq", "documents", "chosen", "why"),
    [
        ("gpu", "bfloat16", 128, 4096, False, "cudnn", "cuDNN"),
        ("gpu", "float32", 128, 4096, False, "blockwise", "takes 16-bit heads, these are float32"),
        ("gpu", "float16", 160, 4096, False, "blockwise", "up to 128 in steps of 8, not 160"),
        ("gpu", "bfloat16", 64, 4096, True, "blockwise", "packed into one sequence"),
        ("tpu", "bfloat16", 128, 4096, True, "splash", "splash"),
        ("tpu", "bfloat16", 128, 1000, False, "blockwise", "blocks of 128 tokens, not 1000"),
        ("cpu", "bfloat16", 128, 4096, False, "blockwise", "no fused attention kernel on cpu"),
    ],
)
def test_each_backend_takes_its_fused_kernel_where_it_applies(
    backend: str, dtype: str, head_dim: int, seq: int, documents: bool, chosen: str, why: str
) -> None:
    got, reason = flash_implementation(backend, dtype, head_dim, seq, documents)
    assert got == chosen and why in reason


def test_the_blockwise_core_keeps_no_scores() -> None:
    """XLA's memory analysis of the core's gradient at 4096 tokens against 1024: the dense
    core's grows with the square of the sequence, the blockwise one's with the sequence."""

    def temp(core: Callable[..., jax.Array], seq: int) -> int:
        q = jax.ShapeDtypeStruct((1, seq, 2, 2, 32), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32)
        grad = jax.grad(lambda q, k, v: core(q, k, v).sum(), argnums=(0, 1, 2))
        stats = jax.jit(grad).lower(q, kv, kv).compile().memory_analysis()
        return int(stats.temp_size_in_bytes)

    mask = A.Mask(True, None)
    dense = [temp(lambda q, k, v: A.dense_core(q, k, v, mask=mask), s) for s in (1024, 4096)]
    flash = [temp(lambda q, k, v: A.flash_attention(q, k, v, mask=mask, block=512), s) for s in (1024, 4096)]
    assert dense[1] / dense[0] > 12  # the scores: 16x the elements
    assert flash[1] / flash[0] <= 4.5
    assert flash[1] < dense[1] / 10
