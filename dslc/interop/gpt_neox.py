"""GPT-NeoX (`GPTNeoXForCausalLM`) checkpoints: Pythia, GPT-NeoX-20B.

Layout: `gpt_neox.embed_in`; per layer `input_layernorm`, `attention.query_key_value` (q, k
and v fused along the output dimension head by head: [heads, 3, head_dim], not q|k|v as
GPT-2's `c_attn`), `attention.dense`, `post_attention_layernorm`, `mlp.dense_h_to_4h`,
`mlp.dense_4h_to_h`; then `gpt_neox.final_layer_norm` and the head `embed_out` (not
`lm_head`). The projections are `nn.Linear`s, whose weights are [out, in]: the transposes of
the spec's kernels. The attention and the MLP read the same input, each through its own
layernorm, and their outputs are added to it (`use_parallel_residual`): a residual of two
`branch`es. Rotary embeddings rotate the first `rotary_pct` of each head's features by
halves (`rotate_half`) and pass the rest, as the attention's `rope_dims` does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from dslc.interop.gpt2 import APPROXIMATE, EXACT
from dslc.interop.hf_config import AnyConfig, GPTNeoXConfig
from dslc.interop.mapping import (
    ARM_CLOSE,
    ARM_OPEN,
    CLOSE,
    OPEN,
    Fact,
    FamilyBase,
    Matched,
    Requirement,
    Structure,
    TensorMap,
    layer_weight,
    with_biases,
)
from dslc.ir import nodes as ir
from dslc.layers import args
from dslc.layers.attention import Attention
from dslc.layers.dense import Embed, Linear
from dslc.layers.elementwise import Gelu
from dslc.layers.norm import LayerNorm

PREFIX = "gpt_neox."
STRUCTURE = Structure(
    "GPT-NeoX",
    ("embed",),
    (
        OPEN,
        *(ARM_OPEN, "layernorm", "attention", ARM_CLOSE),
        *(ARM_OPEN, "layernorm", "linear", "gelu", "linear", ARM_CLOSE),
        CLOSE,
    ),
    ("layernorm", "linear"),
)
# Buffers older checkpoints carry: the causal mask and the rotary frequencies, which dslc
# computes itself.
_BUFFER = re.compile(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)")


class GPTNeoX(FamilyBase):
    name = "GPT-NeoX"
    model_types: tuple[str, ...] = ("gpt_neox",)
    structure = STRUCTURE
    prefix = PREFIX
    buffer = _BUFFER
    tied_by_default = False
    head_tensor = "embed_out.weight"

    def requirements(self, m: Matched) -> list[Requirement]:
        embed = m.prefix[0]
        ln_f = m.suffix[0]
        out = [self.head_has_no_bias(m)]
        for ln_1, attn, ln_2, fc, _, proj in m.blocks:
            a = args(attn, Attention)
            out += [
                Requirement(attn, bool(a.rope), "its attention has rotary embeddings", "write `rope=true`"),
                Requirement(attn, bool(a.causal), "its attention is causal", "write `causal=true`"),
                Requirement(
                    attn,
                    a.kv_heads == a.heads,
                    "every query head has its own key/value head",
                    "leave `kv_heads` to its default",
                ),
                Requirement(
                    attn,
                    a.head_dim * a.heads == args(embed, Embed).dim,
                    "its heads split the model width",
                    "leave `head_dim` to its default",
                ),
                Requirement(
                    attn,
                    bool(a.bias) or not a.qkv_bias,
                    "its attention has biases on q, k, v and o, or on none of them",
                    "write `bias=true` rather than `qkv_bias=true`",
                ),
            ]
            out += with_biases((fc, proj), "MLP's projections") + with_biases((ln_1, ln_2), "layernorms")
        out += with_biases((ln_f,), "layernorms")
        return out

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, GPTNeoXConfig)
        (embed,) = m.prefix
        ln_f = m.suffix[0]
        out = [
            *self.vocab_facts(config.vocab_size, m),
            Fact("hidden_size", config.hidden_size, args(embed, Embed).dim, "width", embed, "d", "change `dim`"),
            Fact(
                "num_hidden_layers",
                config.num_hidden_layers,
                len(m.blocks),
                "number of blocks",
                m.blocks[0][0],
                "layers",
                f"repeat the block {config.num_hidden_layers} times",
            ),
        ]
        for ln_1, attn, ln_2, fc, gelu, proj in m.blocks:
            a = args(attn, Attention)
            out += [
                Fact(
                    "num_attention_heads",
                    config.num_attention_heads,
                    a.heads,
                    "number of attention heads",
                    attn,
                    "heads",
                    "change `heads`",
                ),
                Fact(
                    "rotary_pct",
                    config.rotary_dims,
                    a.rope_dims if a.rope_dims is not None else a.head_dim,
                    "number of rotated features of each head",
                    attn,
                    "rope_dims",
                    f"write `rope_dims={config.rotary_dims}` on the attention",
                    stated=f"{config.rotary_share} ({config.rotary_dims} of each head's {config.head_width} features)",
                ),
                Fact(
                    "rotary_emb_base",
                    config.rope_base,
                    a.rope_base,
                    "rotary base",
                    attn,
                    "rope_base",
                    f"write `rope_base={config.rope_base}` on the attention",
                ),
                Fact(
                    "attention_bias",
                    config.attention_bias,
                    bool(a.bias),
                    "use of attention biases",
                    attn,
                    None,
                    "write `bias=true` on the attention"
                    if config.attention_bias
                    else "leave out the attention's `bias`",
                ),
                Fact(
                    "intermediate_size",
                    config.intermediate_size,
                    args(fc, Linear).out,
                    "MLP width",
                    fc,
                    "ffn",
                    "change `out`",
                ),
                Fact(
                    "intermediate_size",
                    config.intermediate_size,
                    args(proj, Linear).in_,
                    "MLP width",
                    proj,
                    "ffn",
                    "change `in`",
                ),
                activation_fact(config.hidden_act, gelu),
            ]
            out += [
                Fact(
                    "layer_norm_eps",
                    config.layer_norm_eps,
                    args(ln, LayerNorm).eps,
                    "layernorm eps",
                    ln,
                    "eps",
                    "change `eps`",
                )
                for ln in (ln_1, ln_2)
            ]
        out.append(
            Fact(
                "layer_norm_eps",
                config.layer_norm_eps,
                args(ln_f, LayerNorm).eps,
                "layernorm eps",
                ln_f,
                "eps",
                "change `eps`",
            )
        )
        out.append(self.tied_fact(config.tie_word_embeddings, m, program))
        return out

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, GPTNeoXConfig)
        out = []
        if config.hidden_act not in APPROXIMATE + EXACT:
            out.append(
                (
                    f"hidden_act {config.hidden_act!r} is not one dslc computes",
                    "dslc's gelu is gelu_new (tanh) or gelu (erf)",
                )
            )
        if not config.use_parallel_residual:
            out.append(
                (
                    "use_parallel_residual is false: dslc maps GPT-NeoX blocks whose attention and MLP read the same "
                    "input, x + attn(ln_1(x)) + mlp(ln_2(x))",
                    "blocks that run the MLP after the attention's residual (as GPT-2's do) are not mapped",
                )
            )
        if config.rope_type != "default":
            out.append(
                (
                    f"rope type {config.rope_type!r}: dslc's rotary embeddings are unscaled",
                    "scaled variants (linear, dynamic) are not supported",
                )
            )
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        (embed,) = m.prefix
        ln_f = m.suffix[0]
        out = [TensorMap(PREFIX + "embed_in.weight", (layer_weight(embed, "table"),))]
        for i, (ln_1, attn, ln_2, fc, _, proj) in enumerate(m.blocks):
            at = f"{PREFIX}layers.{i}."
            heads = args(attn, Attention).heads
            out += [
                TensorMap(at + "input_layernorm.weight", (layer_weight(ln_1, "scale"),)),
                TensorMap(at + "input_layernorm.bias", (layer_weight(ln_1, "bias"),)),
                TensorMap(at + "post_attention_layernorm.weight", (layer_weight(ln_2, "scale"),)),
                TensorMap(at + "post_attention_layernorm.bias", (layer_weight(ln_2, "bias"),)),
                TensorMap(
                    at + "attention.query_key_value.weight",
                    tuple(layer_weight(attn, w) for w in "qkv"),
                    transposed=True,
                    kernel=True,
                    heads=heads,
                ),
                TensorMap(at + "attention.dense.weight", (layer_weight(attn, "o"),), transposed=True, kernel=True),
            ]
            if args(attn, Attention).bias:
                out += [
                    TensorMap(
                        at + "attention.query_key_value.bias",
                        tuple(layer_weight(attn, f"{w}_bias") for w in "qkv"),
                        heads=heads,
                    ),
                    TensorMap(at + "attention.dense.bias", (layer_weight(attn, "o_bias"),)),
                ]
            out += [
                TensorMap(at + "mlp.dense_h_to_4h.weight", (layer_weight(fc, "kernel"),), transposed=True, kernel=True),
                TensorMap(at + "mlp.dense_h_to_4h.bias", (layer_weight(fc, "bias"),)),
                TensorMap(
                    at + "mlp.dense_4h_to_h.weight", (layer_weight(proj, "kernel"),), transposed=True, kernel=True
                ),
                TensorMap(at + "mlp.dense_4h_to_h.bias", (layer_weight(proj, "bias"),)),
            ]
        out += [
            TensorMap(PREFIX + "final_layer_norm.weight", (layer_weight(ln_f, "scale"),)),
            TensorMap(PREFIX + "final_layer_norm.bias", (layer_weight(ln_f, "bias"),)),
        ]
        if not tied:
            out.append(self.head(m))
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        (embed,) = m.prefix
        ln_1, attn, _, fc, gelu, _ = m.blocks[0]
        a = args(attn, Attention)
        return {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "vocab_size": args(embed, Embed).vocab,
            "hidden_size": args(embed, Embed).dim,
            "num_hidden_layers": len(m.blocks),
            "num_attention_heads": a.heads,
            "intermediate_size": args(fc, Linear).out,
            "hidden_act": "gelu_new" if args(gelu, Gelu).approximate else "gelu",
            "rotary_pct": _rotary_pct(a.rope_dims if a.rope_dims is not None else a.head_dim, a.head_dim),
            "rotary_emb_base": a.rope_base,
            "max_position_embeddings": program.input(program.stream).type.shape[-1],
            "layer_norm_eps": args(ln_1, LayerNorm).eps,
            "use_parallel_residual": True,
            "attention_bias": bool(a.bias),
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        # Later transformers 4 releases write the rotary base and share again as
        # `rope_theta` and `partial_rotary_factor`, 5 in `rope_parameters`.
        rotary = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
        return self.keep_rotary(super().keep(written, original), written, original, rotary)


def activation_fact(hidden_act: str, gelu: ir.Layer) -> Fact:
    """The MLP's GELU: the config's tanh forms are the spec's `gelu()`, its `gelu` the exact
    `gelu(approximate=false)`."""
    tanh = hidden_act if hidden_act in APPROXIMATE else APPROXIMATE[0]
    return Fact(
        "hidden_act",
        hidden_act,
        tanh if args(gelu, Gelu).approximate else EXACT[0],
        "GELU",
        gelu,
        None,
        "write `gelu(approximate=false)` for gelu, `gelu()` for gelu_new",
    )


def _rotary_pct(dims: int, width: int) -> float:
    """The share of a head's `width` features that makes transformers rotate `dims` of them,
    int(width * share): the least float that does, as dims / width itself may fall just
    short (1 / 49 * 49 is 0.9999999999999999)."""
    share = dims / width
    while int(width * share) < dims:
        share = math.nextafter(share, math.inf)
    return share
