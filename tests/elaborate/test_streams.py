"""Streams: `stream NAME(INPUT) { ... }` computes a second activation that later layers read by
name — an encoder's output for cross-attention (`memory=`), T5's relative position bias
(`position_bias=`).

Numerics against tests/reference.py, a single-device computation that knows nothing of the
mesh (its cross-attention projects the keys from the memory head by head, its position
buckets are T5's `_relative_position_bucket` in numpy): specs/t5.par at a small size, computing
in f32, on one device and on 2x2 (batch over `data`, heads and MLP over `model`; and with
the encoder's tokens split over `model` too, gathered at the end of its stream). Tolerance:
tests/tolerances.py's F32, 3e-5 of each gradient's norm — the sharded run sums partial
products in another order; dropping the memory (self-attention in its place) or the bias
moves the loss or leaves a table unlearnt (checked below, so the comparison could fail).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import dslc
from dslc.ir import nodes as ir
from dslc.plan import plan
from dslc.runtime.attention import relative_position_bias
from tests import reference
from tests.conftest import SPECS, compiled
from tests.layouts import TEST_SIZES
from tests.tolerances import F32

T5 = (SPECS / "t5.par").read_text().replace("compute_dtype bf16", "compute_dtype f32")
SIZES = TEST_SIZES["t5"]["overrides"]


def _sequence_parallel(text: str) -> str:
    """T5 with its encoder's tokens split over `model` between the blocks' tensor-parallel
    layers (Megatron's sequence parallelism: each block's row-parallel sum reduce-scattered),
    gathered whole at the stream's end for cross-attention to read."""
    start, end = text.index("block t5_encoder"), text.index("block t5_decoder")
    block = text[start:end].replace("]\n  }", "]\n    layout [data, model, _]\n  }")
    text = text[:start] + block + text[end:]
    return text.replace(
        "    embed: embed(vocab, d) shard table[model, _]\n"
        "    layers: repeat layers t5_encoder(d, heads, head_dim, ffn, eps)\n"
        "    norm: rmsnorm(d, eps=eps)\n",
        "    embed: embed(vocab, d) shard table[model, _]\n    layout [data, model, _]\n"
        "    layers: repeat layers t5_encoder(d, heads, head_dim, ffn, eps)\n    norm: rmsnorm(d, eps=eps)\n"
        "    layout [data, _, _]\n",
    )


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.sample(2)
@pytest.mark.parametrize(("mesh", "sequence_parallel"), [("1x1", False), ("2x2", False), ("2x2", True)])
def test_an_encoder_decoder_computes_what_the_reference_does(mesh: str, sequence_parallel: bool) -> None:
    text = _sequence_parallel(T5) if sequence_parallel else T5
    assert not sequence_parallel or text.count("layout [data, model, _]") == 3
    c = compiled(text, mesh, SIZES)
    want = reference.evaluate(c.program.ir, c.weights, c.batch)
    assert want.loss is not None
    assert abs(c.loss - want.loss) <= F32.loss * abs(want.loss)
    errors = {name: _relative_error(c.grads[name], g) for name, g in want.grads.items()}
    assert max(errors.values()) <= F32.grads, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # Every stream's weights learn: the encoder through cross-attention, each bias table
    # through the layers that add it.
    for name in ("encoded.layers.0.self_attn.attn.q", "encoder_bias.bias.table", "decoder_bias.bias.table"):
        assert np.linalg.norm(want.grads[name]) > 0, name


def test_the_memory_changes_the_loss() -> None:
    """What the comparison above would miss if cross-attention ignored the encoder: with its
    memory the decoder's own embedded tokens instead, the loss moves by far more than the
    tolerance. (A bias ignored would leave its table's gradient 0 where the reference's is
    not: the test above checks that each table learns.)"""
    base = compiled(T5, "1x1", SIZES)
    text = T5.replace("memory=encoded", "memory=encoded_again").replace(
        "  stream decoder_bias(decoder_tokens) {",
        "  stream encoded_again(decoder_tokens) {\n    embed: embed(vocab, d)\n  }\n"
        "  stream decoder_bias(decoder_tokens) {",
    )
    other = compiled(text, "1x1", SIZES)
    assert abs(other.loss - base.loss) > 100 * F32.loss * abs(base.loss)


def _t5_bucket(distance: int, buckets: int, max_distance: int, bidirectional: bool) -> int:
    """One key-minus-query distance's bucket, as T5's paper and code define it, scalar by scalar."""
    bucket = 0
    if bidirectional:
        buckets //= 2
        bucket = buckets if distance > 0 else 0
        distance = abs(distance)
    else:
        distance = max(-distance, 0)
    exact = buckets // 2
    if distance < exact:
        return bucket + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (buckets - exact))
    return bucket + min(far, buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_are_t5s(bidirectional: bool) -> None:
    """Each (query, key) of a 300-token sequence reads the table row of its distance's bucket:
    the exact ones, the logarithmic ones, and the far ones past max_distance sharing the last."""
    buckets, heads, seq = 32, 3, 300
    table = np.arange(buckets * heads, dtype=np.float32).reshape(buckets, heads)
    got = np.asarray(
        relative_position_bias(
            jnp.zeros((1, seq), jnp.int32),
            jnp.asarray(table),
            bidirectional=bidirectional,
            max_distance=128,
            dtype="float32",
        )
    )
    assert got.shape == (1, heads, seq, seq)
    rows = got[0, 0] / heads  # head 0's column holds 3 * bucket
    want = np.array([[_t5_bucket(k - q, buckets, 128, bidirectional) for k in range(seq)] for q in range(seq)])
    np.testing.assert_array_equal(rows.astype(int), want)
    # Far keys share the last bucket of their direction (a later key, in a decoder: distance
    # 0); near ones have buckets of their own.
    assert want[0, seq - 1] == (buckets - 1 if bidirectional else 0)
    assert want[seq - 1, 0] == (buckets // 2 - 1 if bidirectional else buckets - 1)
    near = want[150, 143:158] if bidirectional else want[150, 135:151]
    assert len(set(near.tolist())) == len(near)


def test_the_plan_counts_the_encoder_and_the_cross_attention() -> None:
    """Cross-attention's keys come from the memory: its FLOPs grow with the source's length,
    and the planner counts the encoder's output once, held for every layer that reads it."""
    short, longer = (_checked({**SIZES, "seq": seq}) for seq in (SIZES["seq"], 2 * SIZES["seq"]))
    (cross,) = {layer.flops for layer in ir.all_layers(short) if layer.path == "layers.cross_attn.attn"}
    (cross_long,) = {layer.flops for layer in ir.all_layers(longer) if layer.path == "layers.cross_attn.attn"}
    assert cross_long > cross
    encoded = next(node for node in short.streams if node.path == "encoded")
    assert encoded.result.shape == (SIZES["batch"], SIZES["seq"], SIZES["d"])
    assert plan(longer).memory.activations > plan(short).memory.activations


def _checked(sizes: dict[str, int]) -> ir.Program:
    analysis = dslc.analyze(T5, mesh="1x1", overrides=sizes)
    assert analysis.program is not None
    return analysis.program


def test_the_generated_module_keeps_each_stream_among_the_inputs() -> None:
    source = compiled(T5, "1x1", SIZES).program.source
    assert 'encoded_stream = inputs["tokens"]' in source
    assert 'inputs = {**inputs, "encoded": encoded_stream}' in source
    assert 'memory=inputs["encoded"]' in source
    assert 'position_bias=inputs["decoder_bias"]' in source
