"""The layer rules' FLOPs follow one convention (`LayerRule.flops`): here, that every layer kind
with a bias counts adding it the same way."""

from __future__ import annotations

import pytest

import dslc
from dslc.ir import nodes as ir

SEQUENCES = "model m\nmesh data=2\ninput x: f32[8 @ data, 4, 16]\n"
IMAGES = "model m\nmesh data=2\ninput x: f32[8 @ data, 6, 6, 3]\n"

# (header, the layer with biases, the same layer without, how many bias elements it adds per
# token: per position of its output)
BIASED = {
    "linear": (SEQUENCES, "linear(16, 32)", "linear(16, 32, bias=false)", 32),
    "conv": (IMAGES, "conv(3, 8, kernel=3)", "conv(3, 8, kernel=3, bias=false)", 8),
    "attention qkv_bias": (SEQUENCES, "attention(16, 4, qkv_bias=true)", "attention(16, 4)", 3 * 16),
    "attention bias": (SEQUENCES, "attention(16, 4, bias=true)", "attention(16, 4)", 4 * 16),
    "attention grouped qkv_bias": (
        SEQUENCES,
        "attention(16, 4, kv_heads=2, qkv_bias=true)",
        "attention(16, 4, kv_heads=2)",
        16 + 2 * 2 * 4,
    ),
    "layernorm": (SEQUENCES, "layernorm(16)", "layernorm(16, bias=false)", 16),
}


def layer(header: str, call: str) -> ir.Layer:
    analysis = dslc.analyze(f"{header}forward(x) {{\n  l: {call}\n}}\n")
    assert analysis.ok and analysis.program is not None, analysis.diagnostics
    (found,) = ir.layers(analysis.program.nodes)
    return found


def bias_flops_per_element_and_token(header: str, biased: str, unbiased: str, elements: int) -> float:
    with_bias, without = layer(header, biased), layer(header, unbiased)
    tokens = with_bias.output.numel // with_bias.output.shape[-1]
    return (with_bias.flops - without.flops) / (elements * tokens)


@pytest.mark.parametrize("kind", BIASED)
def test_every_layer_kind_counts_a_bias_add_as_one_flop_per_element_and_token(kind: str) -> None:
    """One rule for every kind: adding a bias costs one FLOP per element it adds, b·s per bias
    element, whether the bias is a linear's, a convolution's, attention's or a layernorm's."""
    assert bias_flops_per_element_and_token(*BIASED[kind]) == 1


def test_a_linear_and_an_attention_count_their_biases_alike() -> None:
    linear = bias_flops_per_element_and_token(*BIASED["linear"])
    attention = bias_flops_per_element_and_token(*BIASED["attention qkv_bias"])
    assert linear == attention
