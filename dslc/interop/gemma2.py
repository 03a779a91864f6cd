"""Gemma 2 (`Gemma2ForCausalLM`) checkpoints.

Layout: `model.embed_tokens`; per layer `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`post_attention_layernorm` (which norms the attention's output, inside the residual: not
Llama's norm of the same name, before the MLP), `pre_feedforward_layernorm`,
`mlp.{gate,up,down}_proj`, `post_feedforward_layernorm`; then `model.norm`, and `lm_head`
only where the config unties it from the embedding (Gemma 2's never do). The projections are
`nn.Linear`s, whose weights are [out, in]: the transposes of the spec's kernels. Each norm's
weight is the offset of its scale from 1, as `rmsnorm(..., offset=true)` stores it. Rotary
embeddings rotate halves of each head (`rotate_half`), as dslc's do, so q and k need no
permutation.

What the spec computes that a Llama's does not: the embedding scaled by sqrt(d) in the
compute dtype (`scale=true`; transformers rounds its normalizer to the hidden states' dtype
too), a GeGLU MLP with the tanh GELU (`activation=gelu`), the attention scores capped before
the mask (`softcap`), the even layers' attention over a sliding window and the odd ones'
over every earlier token, and the logits capped after the head (a `softcap` layer). A
window's convention is the same on both sides: transformers' sliding mask hides key k from
query q where q - k >= sliding_window, dslc's `window` where q - k >= window.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from dslc.interop.gpt2 import APPROXIMATE
from dslc.interop.hf_config import AnyConfig, Gemma2Config
from dslc.interop.mapping import (
    CLOSE,
    OPEN,
    Fact,
    FamilyBase,
    Matched,
    Requirement,
    Structure,
    TensorMap,
    layer_weight,
)
from dslc.ir import nodes as ir
from dslc.layers import args
from dslc.layers.attention import Attention, AttentionArgs
from dslc.layers.dense import Embed, Linear, SwiGLU
from dslc.layers.elementwise import Softcap
from dslc.layers.norm import RmsNorm

PREFIX = "model."
STRUCTURE = Structure(
    "Gemma 2",
    ("embed",),
    (OPEN, "rmsnorm", "attention", "rmsnorm", CLOSE, OPEN, "rmsnorm", "swiglu", "linear", "rmsnorm", CLOSE),
    ("rmsnorm", "linear", "softcap"),
)
# Gemma 2 checkpoints carry no buffers: its rotary frequencies were never saved.
_NO_BUFFER = re.compile(r"(?!)")
# Each layer's tensors after `model.layers.N.`, with the index of the spec's layer that holds
# them in a matched block: its four norms' scales.
_NORMS = (
    ("input_layernorm", 0),
    ("post_attention_layernorm", 2),
    ("pre_feedforward_layernorm", 3),
    ("post_feedforward_layernorm", 6),
)


def _alternating(layers: int) -> list[str]:
    """transformers' `layer_types` for Gemma 2: the even layers sliding, the odd ones full."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


class Gemma2(FamilyBase):
    name = "Gemma 2"
    model_types: tuple[str, ...] = ("gemma2",)
    structure = STRUCTURE
    prefix = PREFIX
    buffer = _NO_BUFFER
    tied_by_default = True
    head_at = -2  # before the cap on the logits
    # Its query_pre_attn_scalar is the attention's `scale`.
    attention_arguments = frozenset({"scale", "window", "softcap"})

    def requirements(self, m: Matched) -> list[Requirement]:
        (embed,) = m.prefix
        norms = [block[i] for block in m.blocks for _, i in _NORMS] + [m.suffix[0]]
        out = [
            self.head_has_no_bias(m),
            Requirement(
                embed, bool(args(embed, Embed).scale), "its embedding is scaled by sqrt(d)", "write `scale=true`"
            ),
        ]
        out += [
            Requirement(
                n,
                bool(args(n, RmsNorm).offset),
                "its norms store their scale as an offset from 1",
                "write `offset=true`",
            )
            for n in norms
        ]
        for i, block in enumerate(m.blocks):
            attn, gate_up, down = block[1], block[4], block[5]
            a = args(attn, Attention)
            out += [
                Requirement(
                    attn,
                    bool(a.rope) and a.rope_dims is None,
                    "its attention rotates every feature of each head",
                    "write `rope=true` (and no `rope_dims`)",
                ),
                Requirement(attn, bool(a.causal), "its attention is causal", "write `causal=true`"),
                Requirement(
                    attn,
                    bool(a.bias) or not a.qkv_bias,
                    "its attention's biases, where it has them, are on q, k, v and o alike",
                    "write `bias=true` in place of `qkv_bias=true`",
                ),
                Requirement(
                    attn,
                    a.window is not None,
                    "its even layers (0, 2, ...) attend within a sliding window",
                    "write `window=...` on the attention",
                )
                if i % 2 == 0
                else Requirement(
                    attn,
                    a.window is None,
                    "its odd layers (1, 3, ...) attend to every earlier token",
                    "leave out `window` on the attention",
                ),
                Requirement(
                    gate_up,
                    args(gate_up, SwiGLU).activation == "gelu",
                    "its MLP gates with the tanh GELU (GeGLU)",
                    "write `activation=gelu`",
                ),
                Requirement(down, not args(down, Linear).bias, "its MLP has no biases", "write `bias=false`"),
            ]
        return out

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, Gemma2Config)
        (embed,) = m.prefix
        norm, _, cap = m.suffix
        out = [
            *self.vocab_facts(config.vocab_size, m),
            Fact("hidden_size", config.hidden_size, args(embed, Embed).dim, "width", embed, "d", "change `dim`"),
            Fact(
                "num_hidden_layers",
                config.num_hidden_layers,
                len(m.blocks),
                "number of layers",
                m.blocks[0][0],
                "layers",
                f"write {config.num_hidden_layers} decoder layers",
            ),
        ]
        for block in m.blocks:
            attn, gate_up, down = block[1], block[4], block[5]
            out += [*_attention_facts(config, attn), *_mlp_facts(config, gate_up, down)]
            out += [_eps_fact(config, block[i]) for _, i in _NORMS]
        out.append(_eps_fact(config, norm))
        if config.final_logit_softcapping is not None:
            out.append(
                Fact(
                    "final_logit_softcapping",
                    config.final_logit_softcapping,
                    args(cap, Softcap).cap,
                    "cap on the logits",
                    cap,
                    "logit_cap",
                    f"write `softcap({config.final_logit_softcapping})`",
                )
            )
        out.append(self.tied_fact(config.tie_word_embeddings, m, program))
        return out

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, Gemma2Config)
        out = []
        if config.hidden_activation not in APPROXIMATE:
            out.append(
                (
                    f"hidden_activation {config.hidden_activation!r}: dslc's GeGLU gates with the tanh GELU",
                    "gelu_pytorch_tanh and gelu_new are the tanh GELU",
                )
            )
        if config.rope_type != "default":
            out.append((f"rope type {config.rope_type!r}: dslc's rotary embeddings are unscaled", ""))
        if config.final_logit_softcapping is None:
            out.append(
                (
                    "final_logit_softcapping is null: dslc maps Gemma 2 checkpoints whose logits are capped",
                    "the spec's head is followed by a `softcap` layer",
                )
            )
        kinds, alternating = config.layer_types, _alternating(config.num_hidden_layers)
        if kinds is not None and kinds != alternating:
            wrong = [i for i, kind in enumerate(kinds) if i >= len(alternating) or kind != alternating[i]]
            out.append(
                (
                    "layer_types is not Gemma 2's alternation: dslc maps checkpoints whose even layers are "
                    "sliding_attention and odd ones full_attention",
                    f"layer {wrong[0]} is {kinds[wrong[0]]!r}"
                    if wrong
                    else f"{len(kinds)} layer types for {config.num_hidden_layers} layers",
                )
            )
        if config.use_bidirectional_attention:
            out.append(("use_bidirectional_attention is true: dslc's Gemma 2 attention is causal", ""))
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        (embed,) = m.prefix
        norm = m.suffix[0]
        out = [TensorMap(PREFIX + "embed_tokens.weight", (layer_weight(embed, "table"),))]
        for i, block in enumerate(m.blocks):
            attn, gate_up, down = block[1], block[4], block[5]
            at = f"{PREFIX}layers.{i}."
            out += [TensorMap(f"{at}{name}.weight", (layer_weight(block[j], "scale"),)) for name, j in _NORMS]
            biased = {w.name for w in attn.weights}
            for w in "qkvo":
                out.append(
                    TensorMap(f"{at}self_attn.{w}_proj.weight", (layer_weight(attn, w),), transposed=True, kernel=True)
                )
                if f"{w}_bias" in biased:
                    out.append(TensorMap(f"{at}self_attn.{w}_proj.bias", (layer_weight(attn, f"{w}_bias"),)))
            out += [
                TensorMap(at + "mlp.gate_proj.weight", (layer_weight(gate_up, "gate"),), transposed=True, kernel=True),
                TensorMap(at + "mlp.up_proj.weight", (layer_weight(gate_up, "up"),), transposed=True, kernel=True),
                TensorMap(at + "mlp.down_proj.weight", (layer_weight(down, "kernel"),), transposed=True, kernel=True),
            ]
        out.append(TensorMap(PREFIX + "norm.weight", (layer_weight(norm, "scale"),)))
        if not tied:
            out.append(self.head(m))
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        (embed,) = m.prefix
        attn_norm, attn, *_ = m.blocks[0]
        a = args(attn, Attention)
        return {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "vocab_size": args(embed, Embed).vocab,
            "hidden_size": args(embed, Embed).dim,
            "intermediate_size": args(m.blocks[0][4], SwiGLU).hidden,
            "num_hidden_layers": len(m.blocks),
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": args(attn_norm, RmsNorm).eps,
            "rope_theta": a.rope_base,
            "max_position_embeddings": program.input(program.stream).type.shape[-1],
            "attention_bias": bool(a.bias),
            # Gemma 2 scales the scores by this ** -0.5, dslc by `scale`.
            "query_pre_attn_scalar": query_scalar(a),
            "sliding_window": a.window,
            "layer_types": _alternating(len(m.blocks)),
            "attn_logit_softcapping": a.softcap,
            "final_logit_softcapping": args(m.suffix[-1], Softcap).cap,
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        return self.keep_rotary(super().keep(written, original), written, original, {"rope_theta": "rope_theta"})


def query_scalar(a: AttentionArgs) -> int | float:
    """What Gemma 2's config calls query_pre_attn_scalar for an attention that scales its
    scores by `a.score_scale`: its inverse square, a whole number where it rounds to one."""
    scalar = a.score_scale**-2
    return round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-9) else scalar


def _attention_facts(config: Gemma2Config, attn: ir.Layer) -> list[Fact]:
    """What one layer's attention and config.json both state: its window too where the spec
    gives it one (the even layers' requirement asks for one, the odd ones' for none)."""
    a = args(attn, Attention)
    bias_fix = "write `bias=true` on the attention" if config.attention_bias else "leave out the attention's biases"
    capped = config.attn_logit_softcapping
    cap_fix = f"write `softcap={capped}` on the attention" if capped else "leave out the attention's `softcap`"
    out = [
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
            "num_key_value_heads",
            config.num_key_value_heads,
            a.kv_heads,
            "number of key/value heads",
            attn,
            "kv_heads",
            "change `kv_heads`",
        ),
        Fact(
            "head_dim",
            config.head_dim,
            a.head_dim,
            "head width",
            attn,
            "head_dim",
            f"write `head_dim={config.head_dim}` on the attention",
        ),
        Fact("rope_theta", config.rope_base, a.rope_base, "rotary base", attn, "rope_base", "change `rope_base`"),
        # transformers scales the scores by query_pre_attn_scalar ** -0.5, dslc by `scale`
        # (1/sqrt(head_dim) when left out): compared as the scalar the spec's scale implies.
        Fact(
            "query_pre_attn_scalar",
            config.query_pre_attn_scalar,
            query_scalar(a),
            "query scalar (its scores scaled by 1/sqrt of it)",
            attn,
            None,
            f"write `scale={config.query_pre_attn_scalar**-0.5!r}` on the attention layers "
            f"(1/sqrt({config.query_pre_attn_scalar:g}), Gemma-2-27B's for heads of 128)",
            stated=f"{config.query_pre_attn_scalar:g}",
        ),
        Fact("attention_bias", config.attention_bias, bool(a.bias), "use of attention biases", attn, None, bias_fix),
        # A config without a cap is an edit of the spec, not a `--set`: no value of `attn_cap` is none.
        Fact(
            "attn_logit_softcapping",
            capped,
            a.softcap,
            "cap on attention scores",
            attn,
            "attn_cap" if capped is not None else None,
            cap_fix,
        ),
    ]
    if a.window is not None:
        out.append(
            Fact(
                "sliding_window",
                config.sliding_window,
                a.window,
                "sliding window",
                attn,
                "window",
                f"write `window={config.sliding_window}` on the attention",
            )
        )
    return out


def _mlp_facts(config: Gemma2Config, gate_up: ir.Layer, down: ir.Layer) -> list[Fact]:
    return [
        Fact(
            "intermediate_size",
            config.intermediate_size,
            args(gate_up, SwiGLU).hidden,
            "MLP width",
            gate_up,
            "ffn",
            "change the swiglu's `hidden`",
        ),
        Fact(
            "intermediate_size", config.intermediate_size, args(down, Linear).in_, "MLP width", down, "ffn",
            "change `in`",
        ),
    ]  # fmt: skip


def _eps_fact(config: Gemma2Config, norm: ir.Layer) -> Fact:
    eps = args(norm, RmsNorm).eps
    return Fact("rms_norm_eps", config.rms_norm_eps, eps, "rmsnorm eps", norm, "eps", "change `eps`")
