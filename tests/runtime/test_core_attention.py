"""`checkpoint core_attention`: Korthikanti et al.'s selective recomputation.

A block so checkpointed keeps every activation but its attention layers' cores (the scores,
their softmax and the probabilities, [batch, heads, seq, seq]); the backward pass reruns
each core from the kept queries, keys and values (`jax.checkpoint` around the core in
`runtime.attention.attention`). Checked: the gradients are the reference's; the traced step's
matrix-multiply FLOPs grow by exactly the planner's recompute, far less than `checkpoint
full`'s; the planner's per-layer activation bytes are the paper's Table 2 formula for the
terms dslc's layers keep as the paper counts them (docs/plan.md lists the others).
"""

from __future__ import annotations

import pytest

import dslc
from dslc.ir.nodes import Block, Program, Repeat
from dslc.plan import plan
from dslc.plan.activations import kept_by
from tests import reference
from tests.conftest import compiled
from tests.jaxpr_flops import dot_flops
from tests.tolerances import assert_grads_close, relative_error

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

# Two pre-norm decoder blocks, data x tensor parallel, f32 so that the comparison with the
# reference is tight.
SPEC = """
model core
mesh data=2, model=2
const vocab = 64
const d = 32
const heads = 4
const seq = 16
input tokens: i32[4 @ data, seq]
input targets: i32[4 @ data, seq]
block decoder(d, heads) checkpoint POLICY {
  residual {
    ln1: layernorm(d)
    attn: attention(d, heads, causal=true) shard q[_, model], k[_, model], v[_, model], o[model, _]
  }
  residual {
    ln2: layernorm(d)
    up: linear(d, 4 * d) shard kernel[_, model], bias[model]
    gelu()
    down: linear(4 * d, d) shard kernel[model, _]
  }
}
forward(tokens) {
  embed: embed(vocab, d)
  blocks: repeat 2 decoder(d, heads)
  ln_f: layernorm(d)
  head: linear(d, vocab, bias=false)
  loss: cross_entropy(targets)
}
"""
# f32 throughout, as in test_data_parallel: recomputation reorders nothing, but the sharded
# step sums over devices in another order than the reference (test_numerics says why 3e-5).
TOLERANCE = 3e-5


def spec(policy: str) -> str:
    return SPEC.replace("POLICY", policy)


def test_gradients_are_the_references() -> None:
    run = compiled(spec("core_attention"))
    want = reference.evaluate(run.program.ir, run.weights, run.batch)
    assert want.loss is not None and relative_error(run.loss, want.loss) <= TOLERANCE
    assert_grads_close(run.grads, want.grads, TOLERANCE)


def test_recompute_flops_are_the_scores_and_far_below_full() -> None:
    def traced(policy: str) -> float:
        return dot_flops(compiled(spec(policy)).program.trace("grads").jaxpr)

    none, core, full = traced("none"), traced("core_attention"), traced("full")
    # The backward reruns each layer's scores q·kᵀ, no other matrix multiply: 2·b·h·s²·hd
    # per layer (the weighted sum of the values is not needed again), as the planner counts.
    program = compiled(spec("core_attention")).program.ir
    scores = 2 * 4 * 4 * 16 * 16 * 8
    assert core - none == 2 * scores == plan(program).flops.recompute
    assert core - none < (full - none) / 10


def _block(program: Program) -> Block:
    (run,) = [n for n in program.nodes if isinstance(n, Repeat)]
    assert isinstance(run.body, Block)
    return run.body


# One block as Korthikanti et al. count it: 16-bit activations, dropout after attention and
# after the MLP, s = 32, b = 8, h = 64, a = 4 heads.
KORTHIKANTI = """
model paper
mesh model=T
input x: bf16[8, 32, 64]
input y: bf16[8, 32, 64]
block layer(d, heads) checkpoint POLICY {
  residual {
    ln1: layernorm(d)
    attn: attention(d, heads, causal=true) shard q[_, model], k[_, model], v[_, model], o[model, _]
    dropout(0.1)
  }
  residual {
    ln2: layernorm(d)
    up: linear(d, 4 * d) shard kernel[_, model], bias[model]
    gelu(approximate=true)
    down: linear(4 * d, d) shard kernel[model, _]
    dropout(0.1)
  }
}
forward(x) {
  layers: repeat 1 layer(64, 4)
  loss: mse(y)
}
train {
  param_dtype bf16
  compute_dtype bf16
}
"""


def _kept_per_layer(spec: str, policy: str, t: int) -> int:
    analysis = dslc.analyze(spec.replace("POLICY", policy).replace("=T", f"={t}"))
    assert analysis.program is not None and not analysis.diagnostics
    program = analysis.program
    return kept_by((_block(program),), program.mesh, "bf16", 1).kept


S, B, H, A = 32, 8, 64, 4
SBH = S * B * H
# What dslc's layers keep beyond the paper's count: each layernorm's per-row mean and
# 1 / standard deviation in f32 (two layernorms: 16 bytes per token), where the paper counts
# the input alone. Norms, GeLU and dropout keep what a fused kernel keeps (their 16-bit input,
# the mask as one byte) since their own backward passes (dslc.runtime.layers).
STATISTICS = 2 * 2 * 4 * S * B


@pytest.mark.parametrize("t", [1, 2])
def test_activation_bytes_per_layer_follow_korthikanti(t: int) -> None:
    # Table 2, tensor parallel with selective recomputation: sbh(10 + 24/t) bytes per layer.
    paper = SBH * (10 + 24 // t)
    assert _kept_per_layer(KORTHIKANTI, "core_attention", t) == paper + STATISTICS
    # What `core_attention` drops is the softmax's output, 2as²b/t: the paper's 5as²b/t less
    # attention dropout's mask and output (dslc's attention has no dropout). The dense core's
    # softmax keeps nothing else (dslc.runtime.attention._softmax).
    dropped = _kept_per_layer(KORTHIKANTI, "none", t) - _kept_per_layer(KORTHIKANTI, "core_attention", t)
    assert dropped == 2 * A * S * S * B // t


# The same block with sequence parallelism: the tokens split over `model` outside the
# tensor-parallel layers (the norms, dropout, the residual stream).
SEQUENCE_PARALLEL = KORTHIKANTI.replace("bf16[8, 32, 64]", "bf16[8, 32 @ model, 64]").replace(
    "    dropout(0.1)\n  }", "    layout [_, model, _]\n    dropout(0.1)\n  }"
)


@pytest.mark.parametrize("t", [2, 4])
def test_activation_bytes_per_layer_follow_korthikanti_with_sequence_parallelism(t: int) -> None:
    assert SEQUENCE_PARALLEL.count("layout") == 2 and SEQUENCE_PARALLEL.count("@ model") == 2
    # Table 2, tensor and sequence parallel with selective recomputation: sbh(34/t).
    paper = SBH * 34 // t
    # Besides the statistics (of a device's tokens), the attention keeps its operand as its
    # projections read it, the tokens gathered (2sbh), where Megatron keeps its own share and
    # gathers it again in the backward pass (2sbh/t).
    gathered = 2 * SBH - 2 * SBH // t
    assert _kept_per_layer(SEQUENCE_PARALLEL, "core_attention", t) == paper + gathered + STATISTICS // t
