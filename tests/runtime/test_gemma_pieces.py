"""Gemma's building blocks as layer arguments and kinds: the embedding scaled by sqrt(d)
(`embed(..., scale=true)`), norms whose scale is stored as an offset from 1 (`rmsnorm(...,
offset=true)`, initialised at 0), GeGLU (`swiglu(..., activation=gelu)`) and the final
logits' soft cap (`softcap(30.0)`), each against the plain single-device reference
(tests/reference.py) on a data x model mesh, forward, loss and every gradient."""

from __future__ import annotations

import numpy as np
import pytest

import dslc
from tests import reference
from tests.tolerances import F32, assert_grads_close, relative_error

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

GEMMA_LIKE = """
model gemma_like
mesh data=2, model=2
const vocab = 64
const d = 32
const ffn = 64
input tokens: i32[8 @ data, 16]
input targets: i32[8 @ data, 16]
block gemma_block(d, ffn) {
  residual {
    attn_norm: rmsnorm(d, offset=true)
    attn: attention(d, 4, kv_heads=2, rope=true) shard q[_, model], k[_, model], v[_, model], o[model, _]
    post_attn_norm: rmsnorm(d, offset=true)
  }
  residual {
    mlp_norm: rmsnorm(d, offset=true)
    gate_up: swiglu(d, ffn, activation=gelu) shard gate[_, model], up[_, model]
    down: linear(ffn, d, bias=false) shard kernel[model, _]
  }
}
forward(tokens) {
  embed: embed(vocab, d, scale=true) shard table[model, _]
  layers: repeat 2 gemma_block(d, ffn)
  norm: rmsnorm(d, offset=true)
  head: linear(d, vocab, bias=false) shard kernel[_, model]
  softcap(3.0)
  loss: cross_entropy(targets)
}
"""


def test_the_gemma_pieces_match_the_reference() -> None:
    program = dslc.compile(GEMMA_LIKE)
    model = program.init(0)
    weights = program.export_weights(model)
    # Offsets start at 0 (a scale of 1): give them values, so that a missing `1 +` shows.
    rng = np.random.default_rng(0)
    weights = {
        name: rng.normal(0, 0.3, w.shape).astype(np.float32) if name.endswith("norm.scale") else w
        for name, w in weights.items()
    }
    assert sum(name.endswith("norm.scale") for name in weights) == 7
    model = program.load(weights)
    batch = program.example_batch(0)
    want = reference.evaluate(program.ir, weights, batch)
    logits = np.asarray(program.forward(model, batch))
    # The cap binds: logits beyond it would be clipped, the largest sit close to it.
    assert np.abs(logits).max() < 3.0 and np.abs(logits).max() > 1.0
    assert relative_error(logits, want.output) <= F32.forward
    loss, grads = program.loss_and_grads(model, batch)
    assert want.loss is not None and abs(loss - want.loss) <= F32.loss * abs(want.loss)
    assert_grads_close(grads, want.grads, F32.grads)


def test_offset_norms_start_at_zero_and_plain_ones_at_one() -> None:
    """Either way the scale a norm applies starts at 1."""
    for offset, start in (("true", 0.0), ("false", 1.0)):
        program = dslc.compile(GEMMA_LIKE.replace("offset=true", f"offset={offset}"))
        scales = [w for name, w in program.export_weights(program.init(0)).items() if name.endswith("norm.scale")]
        assert len(scales) == 7 and all(np.all(w == start) for w in scales)
