"""The built-in layer kinds, by the name a spec calls them."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from dslc.ir.nodes import Layer
from dslc.layers.attention import Attention, RelativePositionBias
from dslc.layers.base import LayerRule
from dslc.layers.conv import Conv
from dslc.layers.dense import Embed, Linear, PositionEmbed, SwiGLU
from dslc.layers.elementwise import Dropout, Gelu, Relu, Silu, Softcap
from dslc.layers.loss import CrossEntropy, MeanSquaredError
from dslc.layers.moe import MoE
from dslc.layers.norm import LayerNorm, RmsNorm
from dslc.layers.vision import ClassToken, Flatten, Pool

RULES: dict[str, LayerRule[Any]] = {
    rule.kind: rule
    for rule in (
        Linear(),
        Embed(),
        PositionEmbed(),
        LayerNorm(),
        RmsNorm(),
        Attention(),
        RelativePositionBias(),
        Gelu(),
        Relu(),
        Silu(),
        Softcap(),
        SwiGLU(),
        Dropout(),
        Conv(),
        Flatten(),
        ClassToken(),
        Pool(),
        MoE(),
        CrossEntropy(),
        MeanSquaredError(),
    )
}

LOSS_KINDS = frozenset(kind for kind, rule in RULES.items() if rule.is_loss)


A = TypeVar("A")


def args(layer: Layer, rule: type[LayerRule[A]]) -> A:
    """The arguments of `layer`, a use of `rule`'s kind, as its typed `Args`
    (`args(attn, Attention).heads`). What reads a layer's arguments outside its rule reads
    them so, never by name."""
    assert RULES[layer.kind].Args is rule.Args, (layer.kind, rule.kind)
    return cast(A, RULES[rule.kind].args_of(layer))
