"""The pieces other families are built from, as layer arguments and kinds, each against the
plain single-device reference (tests/reference.py) on a data x model mesh: forward, loss and
every gradient.

Gemma's: the embedding scaled by sqrt(d) (`embed(..., scale=true)`), norms whose scale is
stored as an offset from 1 (`rmsnorm(..., offset=true)`, initialised at 0), GeGLU
(`swiglu(..., activation=gelu)`), the attention scores' soft cap (`attention(...,
softcap=50.0)`, in the dense and the flash core) and the final logits' (`softcap(30.0)`).
GPT-NeoX's and GPT-J's: rotary embeddings on part of each head (`rope_dims`)."""

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
mesh data=2, mp=2
const vocab = 64
const d = 32
const ffn = 64
input tokens: i32[8 @ data, 16]
input targets: i32[8 @ data, 16]
block gemma_block(d, ffn) {
  residual {
    attn_norm: rmsnorm(d, offset=true)
    attn: attention(d, 4, kv_heads=2, rope=true, softcap=1.5, kernel=CORE) shard q[_, mp], k[_, mp], v[_, mp], o[mp, _]
    post_attn_norm: rmsnorm(d, offset=true)
  }
  residual {
    mlp_norm: rmsnorm(d, offset=true)
    gate_up: swiglu(d, ffn, activation=gelu) shard gate[_, mp], up[_, mp]
    down: linear(ffn, d, bias=false) shard kernel[mp, _]
  }
}
forward(tokens) {
  embed: embed(vocab, d, scale=true) shard table[mp, _]
  layers: repeat 2 gemma_block(d, ffn)
  norm: rmsnorm(d, offset=true)
  head: linear(d, vocab, bias=false) shard kernel[_, mp]
  softcap(3.0)
  loss: cross_entropy(targets)
}
"""


@pytest.mark.parametrize("kernel", ["dense", "flash"])
def test_the_gemma_pieces_match_the_reference(kernel: str) -> None:
    program = dslc.compile(GEMMA_LIKE.replace("CORE", kernel))
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
        program = dslc.compile(GEMMA_LIKE.replace("offset=true", f"offset={offset}").replace("CORE", "dense"))
        scales = [w for name, w in program.export_weights(program.init(0)).items() if name.endswith("norm.scale")]
        assert len(scales) == 7 and all(np.all(w == start) for w in scales)


def test_capped_scores_are_refused_on_a_ring_and_kept_from_cudnn() -> None:
    """Ring attention takes no cap (E029 at the argument); on a GPU the flash core runs the
    blockwise kernel, not cuDNN's, and `dslc check` says why."""
    from dslc.check.kernels import attention_kernels

    ring = GEMMA_LIKE.replace("CORE", "flash").replace("mesh data=2, mp=2", "mesh context=2, mp=2")
    ring = ring.replace("i32[8 @ data, 16]", "i32[8, 16 @ context]")
    (d,) = [d for d in dslc.check(ring) if d.code == "E029"]
    assert "takes no cap on its scores" in d.message and d.help is not None and "softcap" in d.help
    program = dslc.analyze(GEMMA_LIKE.replace("CORE", "flash").replace("compute_dtype f32", "")).program
    assert program is not None
    (choice,) = {(c.implementation, c.why) for c in attention_kernels(program, "gpu")}
    assert choice[0] == "blockwise" and "softcap" in choice[1]


@pytest.mark.parametrize("kernel", ["dense", "flash"])
def test_capped_attention_is_planned_within_ten_percent_of_xla(kernel: str) -> None:
    """What tests/plan/test_plan.py holds every spec to. The cap keeps the scores before it
    (dense: f32, 4 bytes a score more) or recomputes them beside the capped ones (flash: one
    block more in the backward's working set). Measured at d=128 and 256 tokens: dense 0.986,
    flash 0.970 (0.874 before the flash block was counted)."""
    from dslc.plan import plan

    source = (
        GEMMA_LIKE.replace("CORE", kernel)
        .replace("const d = 32", "const d = 128")
        .replace("i32[8 @ data, 16]", "i32[8 @ data, 256]")
    )
    program = dslc.analyze(source).program
    assert program is not None
    planned = plan(program, backend="cpu").memory.grads_step
    measured = dslc.compile(source).compiled_memory("grads").total
    assert abs(planned / measured - 1) <= 0.10, planned / measured


# ---- partial rotary (GPT-NeoX, GPT-J) -------------------------------------------------------------


def test_partial_rotary_matches_the_reference_and_leaves_the_rest_of_each_head() -> None:
    """`rope_dims=4` of 8-wide heads: the reference rotates the first 4 features only. Against
    the whole-head rotary the outputs differ (so the argument reaches the kernel)."""
    partial = GEMMA_LIKE.replace("CORE", "dense").replace("rope=true,", "rope=true, rope_dims=4,")
    assert partial.count("rope_dims=4") == 1
    program = dslc.compile(partial)
    model = program.init(0)
    weights = program.export_weights(model)
    batch = program.example_batch(0)
    want = reference.evaluate(program.ir, weights, batch)
    got = np.asarray(program.forward(model, batch))
    assert relative_error(got, want.output) <= F32.forward
    loss, grads = program.loss_and_grads(model, batch)
    assert want.loss is not None and abs(loss - want.loss) <= F32.loss * abs(want.loss)
    assert_grads_close(grads, want.grads, F32.grads)
    whole = dslc.compile(GEMMA_LIKE.replace("CORE", "dense"))
    assert relative_error(np.asarray(whole.forward(whole.load(weights), batch)), got) > 1e-3


@pytest.mark.parametrize(("argument", "why"), [("rope_dims=3", "got 3"), ("rope_dims=10", "got 10")])
def test_partial_rotary_takes_an_even_count_up_to_the_head_width(argument: str, why: str) -> None:
    bad = GEMMA_LIKE.replace("CORE", "dense").replace("rope=true,", f"rope=true, {argument},")
    (d,) = [d for d in dslc.check(bad) if d.code == "E024"]
    assert why in d.message and "head_dim = 8" in d.message
