"""GPT-2 (`GPT2LMHeadModel`) checkpoints.

Layout: token and position tables `wte`, `wpe`; per block `ln_1`, `attn.c_attn` (q, k and v
fused along the output dimension), `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`; then
`ln_f`. The projections are `Conv1D`s, whose weights are [in, out] like the spec's kernels.
The head is tied to `wte` (`lm_head.weight`, [vocab, d], is stored only when it is not).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dslc.interop.hf_config import AnyConfig, GPT2Config
from dslc.interop.mapping import (
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
from dslc.layers.dense import Embed, Linear, PositionEmbed
from dslc.layers.elementwise import Gelu
from dslc.layers.norm import LayerNorm

PREFIX = "transformer."
STRUCTURE = Structure(
    "GPT-2",
    ("embed", "position_embed"),
    ("(", "layernorm", "attention", ")", "(", "layernorm", "linear", "gelu", "linear", ")"),
    ("layernorm", "linear"),
)
# Activations that are GELU's tanh approximation, and the exact one.
APPROXIMATE = ("gelu_new", "gelu_pytorch_tanh")
EXACT = ("gelu",)
# Buffers older checkpoints carry: the causal mask, which dslc builds itself.
_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


class GPT2(FamilyBase):
    name = "GPT-2"
    model_types: tuple[str, ...] = ("gpt2",)
    structure = STRUCTURE
    prefix = PREFIX
    buffer = _BUFFER
    tied_by_default = True
    # GPT2Config's other names for n_embd, n_positions, n_head and n_layer.
    determined = frozenset({"hidden_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers"})

    def requirements(self, m: Matched) -> list[Requirement]:
        wte = m.prefix[0]
        ln_f = m.suffix[0]
        out = [self.head_has_no_bias(m)]
        for ln_1, attn, ln_2, fc, _, proj in m.blocks:
            out += [
                Requirement(
                    attn,
                    bool(args(attn, Attention).bias),
                    "its attention adds biases to q, k, v and o",
                    "write `bias=true` on the attention",
                ),
                Requirement(attn, bool(args(attn, Attention).causal), "its attention is causal", "write `causal=true`"),
                Requirement(attn, not args(attn, Attention).rope, "it has no rotary embeddings", "leave `rope` false"),
                Requirement(
                    attn,
                    args(attn, Attention).kv_heads == args(attn, Attention).heads,
                    "every query head has its own key/value head",
                    "leave `kv_heads` to its default",
                ),
                Requirement(
                    attn,
                    args(attn, Attention).head_dim * args(attn, Attention).heads == args(wte, Embed).dim,
                    "its heads split the model width",
                    "leave `head_dim` to its default",
                ),
            ]
            out += with_biases((fc, proj), "projections") + with_biases((ln_1, ln_2, ln_f), "layernorms")
        return out

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, GPT2Config)
        wte, wpe = m.prefix
        ln_f = m.suffix[0]
        first = m.blocks[0]
        out = [
            *self.vocab_facts(config.vocab_size, m),
            Fact(
                "n_positions",
                config.n_positions,
                args(wpe, PositionEmbed).positions,
                "position table's length",
                wpe,
                "positions",
                "change `positions`",
            ),
            Fact("n_embd", config.n_embd, args(wte, Embed).dim, "width", wte, "d", "change the embedding's `dim`"),
            Fact(
                "n_layer",
                config.n_layer,
                len(m.blocks),
                "number of blocks",
                first[0],
                "layers",
                f"repeat the block {config.n_layer} times",
            ),
        ]
        for _, attn, _, fc, gelu, _ in m.blocks:
            approximate = "gelu_new" if args(gelu, Gelu).approximate else "gelu"
            wanted = "gelu_new" if config.activation_function in APPROXIMATE else config.activation_function
            out += [
                Fact(
                    "n_head",
                    config.n_head,
                    args(attn, Attention).heads,
                    "number of attention heads",
                    attn,
                    "heads",
                    "change `heads`",
                ),
                Fact("n_inner", config.ffn, args(fc, Linear).out, "MLP width", fc, "ffn", "change the MLP's width"),
                Fact(
                    "activation_function",
                    wanted,
                    approximate,
                    "GELU",
                    gelu,
                    None,
                    "write `gelu()` for gelu_new, `gelu(approximate=false)` for gelu",
                ),
            ]
        for ln in (*(b[0] for b in m.blocks), *(b[2] for b in m.blocks), ln_f):
            out.append(
                Fact(
                    "layer_norm_epsilon",
                    config.layer_norm_epsilon,
                    args(ln, LayerNorm).eps,
                    "layernorm eps",
                    ln,
                    "eps",
                    "change `eps`",
                )
            )
        out.append(self.tied_fact(config.tie_word_embeddings, m, program))
        return out

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, GPT2Config)
        out = []
        if config.activation_function not in APPROXIMATE + EXACT:
            out.append(
                (
                    f"activation_function {config.activation_function!r} is not one dslc computes",
                    "dslc's gelu is gelu_new (tanh) or gelu (erf)",
                )
            )
        if config.scale_attn_by_inverse_layer_idx:
            out.append(
                ("scale_attn_by_inverse_layer_idx is true: dslc scales attention scores by 1/sqrt(head_dim) only", "")
            )
        if not config.scale_attn_weights:
            out.append(("scale_attn_weights is false: dslc always scales attention scores by 1/sqrt(head_dim)", ""))
        if config.add_cross_attention:
            out.append(("add_cross_attention is true: dslc's GPT-2 is a decoder alone", ""))
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        wte, wpe = m.prefix
        ln_f = m.suffix[0]
        out = [
            TensorMap(PREFIX + "wte.weight", (layer_weight(wte, "table"),)),
            TensorMap(PREFIX + "wpe.weight", (layer_weight(wpe, "table"),)),
        ]
        for i, (ln_1, attn, ln_2, fc, _, proj) in enumerate(m.blocks):
            h = f"{PREFIX}h.{i}."
            out += [
                TensorMap(h + "ln_1.weight", (layer_weight(ln_1, "scale"),)),
                TensorMap(h + "ln_1.bias", (layer_weight(ln_1, "bias"),)),
                TensorMap(h + "attn.c_attn.weight", tuple(layer_weight(attn, w) for w in "qkv"), kernel=True),
                TensorMap(h + "attn.c_attn.bias", tuple(layer_weight(attn, f"{w}_bias") for w in "qkv")),
                TensorMap(h + "attn.c_proj.weight", (layer_weight(attn, "o"),), kernel=True),
                TensorMap(h + "attn.c_proj.bias", (layer_weight(attn, "o_bias"),)),
                TensorMap(h + "ln_2.weight", (layer_weight(ln_2, "scale"),)),
                TensorMap(h + "ln_2.bias", (layer_weight(ln_2, "bias"),)),
                TensorMap(h + "mlp.c_fc.weight", (layer_weight(fc, "kernel"),), kernel=True),
                TensorMap(h + "mlp.c_fc.bias", (layer_weight(fc, "bias"),)),
                TensorMap(h + "mlp.c_proj.weight", (layer_weight(proj, "kernel"),), kernel=True),
                TensorMap(h + "mlp.c_proj.bias", (layer_weight(proj, "bias"),)),
            ]
        out += [
            TensorMap(PREFIX + "ln_f.weight", (layer_weight(ln_f, "scale"),)),
            TensorMap(PREFIX + "ln_f.bias", (layer_weight(ln_f, "bias"),)),
        ]
        if not tied:
            out.append(self.head(m))
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        wte, wpe = m.prefix
        ln_1, attn, _, fc, gelu, _ = m.blocks[0]
        d = args(wte, Embed).dim
        ffn = args(fc, Linear).out
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": args(wte, Embed).vocab,
            "n_positions": args(wpe, PositionEmbed).positions,
            "n_embd": d,
            "n_layer": len(m.blocks),
            "n_head": args(attn, Attention).heads,
            "n_inner": None if ffn == 4 * d else ffn,
            "activation_function": "gelu_new" if args(gelu, Gelu).approximate else "gelu",
            "layer_norm_epsilon": args(ln_1, LayerNorm).eps,
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        out = super().keep(written, original)
        if "n_ctx" in out:  # older configs' n_positions, which transformers no longer reads
            out["n_ctx"] = written["n_positions"]
        return out
