"""Llama (`LlamaForCausalLM`) checkpoints, and those built like it: Mistral (a sliding window,
the attention's `window`, which changes nothing while the sequence fits in it), Qwen2
(biases on q, k and v; a sliding window where `use_sliding_window` says so) and Mixtral (a
Mistral whose MLPs are mixtures of SwiGLU experts).

Layout: `model.embed_tokens`; per layer `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
`post_attention_layernorm`, `mlp.{gate,up,down}_proj`; then `model.norm` and `lm_head`
(left out when tied to the embedding). The projections are `nn.Linear`s, whose weights are
[out, in]: the transposes of the spec's kernels. Rotary embeddings rotate halves of each head
(`rotate_half`), as dslc's do, so q and k need no permutation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dslc.interop.hf_config import AnyConfig, LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from dslc.interop.mapping import (
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
from dslc.layers.attention import Attention
from dslc.layers.dense import Embed, Linear, SwiGLU
from dslc.layers.moe import MoE
from dslc.layers.norm import RmsNorm

PREFIX = "model."
STRUCTURE = Structure(
    "Llama",
    ("embed",),
    ("(", "rmsnorm", "attention", ")", "(", "rmsnorm", "swiglu", "linear", ")"),
    ("rmsnorm", "linear"),
)
# A buffer older checkpoints carry: the rotary frequencies, which dslc computes itself.
_BUFFER = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class Llama(FamilyBase):
    name = "Llama"
    model_types: tuple[str, ...] = ("llama", "mistral", "qwen2")
    structure = STRUCTURE
    prefix = PREFIX
    buffer = _BUFFER
    tied_by_default = False
    # Written for a Llama, left out for a Qwen2 (whose q, k and v biases its type says).
    determined = frozenset({"attention_bias", "mlp_bias"})
    # Mistral's and Qwen2's sliding window (`sliding_window`); queries and keys normalised or
    # not, as the family says (`qk_norm_requirement`).
    attention_arguments = frozenset({"window", "qk_norm"})

    def requirements(self, m: Matched) -> list[Requirement]:
        out = [self.head_has_no_bias(m)]
        for block in m.blocks:
            attn = block[1]
            out += [
                Requirement(
                    attn, bool(args(attn, Attention).rope), "its attention has rotary embeddings", "write `rope=true`"
                ),
                Requirement(attn, bool(args(attn, Attention).causal), "its attention is causal", "write `causal=true`"),
                self.qk_norm_requirement(attn),
                *self.mlp_requirements(block[3:]),
            ]
        return out

    def qk_norm_requirement(self, attn: ir.Layer) -> Requirement:
        return Requirement(
            attn,
            not args(attn, Attention).qk_norm,
            "its attention does not normalise queries and keys",
            "leave out `qk_norm`",
        )

    def mlp_requirements(self, mlp: tuple[ir.Layer, ...]) -> list[Requirement]:
        """What the block's MLP layers (those after its second norm) must be."""
        down = mlp[-1]
        return [Requirement(down, not args(down, Linear).bias, "its MLP has no biases", "write `bias=false`")]

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, LlamaConfig)
        (embed,) = m.prefix
        norm = m.suffix[0]
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
        for block in m.blocks:
            attn_norm, attn, mlp_norm = block[:3]
            out += [
                Fact(
                    "num_attention_heads",
                    config.num_attention_heads,
                    args(attn, Attention).heads,
                    "number of attention heads",
                    attn,
                    "heads",
                    "change `heads`",
                ),
                Fact(
                    "num_key_value_heads",
                    config.kv_heads,
                    args(attn, Attention).kv_heads,
                    "number of key/value heads",
                    attn,
                    "kv_heads",
                    "change `kv_heads`",
                ),
                *_head_width_facts(config, embed, attn),
                *_window_facts(config, attn, program.input(program.stream).type.shape[-1]),
                Fact(
                    "rope_theta",
                    config.rope_base,
                    args(attn, Attention).rope_base,
                    "rotary base",
                    attn,
                    "rope_base",
                    "change `rope_base`",
                ),
                *_bias_facts(config, attn),
                *self.mlp_facts(config, block[3:]),
            ]
            for n in (attn_norm, mlp_norm):
                out.append(
                    Fact(
                        "rms_norm_eps",
                        config.rms_norm_eps,
                        args(n, RmsNorm).eps,
                        "rmsnorm eps",
                        n,
                        "eps",
                        "change `eps`",
                    )
                )
        out.append(
            Fact(
                "rms_norm_eps", config.rms_norm_eps, args(norm, RmsNorm).eps, "rmsnorm eps", norm, "eps", "change `eps`"
            )
        )
        out.append(self.tied_fact(config.tie_word_embeddings, m, program))
        return out

    def mlp_facts(self, config: LlamaConfig, mlp: tuple[ir.Layer, ...]) -> list[Fact]:
        gate_up, down = mlp
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
                "intermediate_size",
                config.intermediate_size,
                args(down, Linear).in_,
                "MLP width",
                down,
                "ffn",
                "change `in`",
            ),
        ]

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, LlamaConfig)
        out = []
        if config.hidden_act != "silu":
            out.append((f"hidden_act {config.hidden_act!r}: dslc's swiglu gates with silu", ""))
        if config.mlp_bias:
            out.append(("mlp_bias is true: dslc's swiglu and its down projection have no biases", ""))
        if config.rope_type != "default":
            out.append(
                (
                    f"rope type {config.rope_type!r}: dslc's rotary embeddings are unscaled",
                    "scaled variants (llama3, linear, dynamic, yarn) are not supported",
                )
            )
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        (embed,) = m.prefix
        norm = m.suffix[0]
        out = [TensorMap(PREFIX + "embed_tokens.weight", (layer_weight(embed, "table"),))]
        for i, block in enumerate(m.blocks):
            attn_norm, attn, mlp_norm = block[:3]
            at = f"{PREFIX}layers.{i}."
            out.append(TensorMap(at + "input_layernorm.weight", (layer_weight(attn_norm, "scale"),)))
            for w in "qkvo":
                out.append(
                    TensorMap(f"{at}self_attn.{w}_proj.weight", (layer_weight(attn, w),), transposed=True, kernel=True)
                )
                if f"{w}_bias" in {x.name for x in attn.weights}:
                    out.append(TensorMap(f"{at}self_attn.{w}_proj.bias", (layer_weight(attn, f"{w}_bias"),)))
            if args(attn, Attention).qk_norm:
                out += [TensorMap(f"{at}self_attn.{w}_norm.weight", (layer_weight(attn, f"{w}_norm"),)) for w in "qk"]
            out.append(TensorMap(at + "post_attention_layernorm.weight", (layer_weight(mlp_norm, "scale"),)))
            out += self.mlp_tensors(at, block[3:])
        out.append(TensorMap(PREFIX + "norm.weight", (layer_weight(norm, "scale"),)))
        if not tied:
            out.append(self.head(m))
        return out

    def mlp_tensors(self, at: str, mlp: tuple[ir.Layer, ...]) -> list[TensorMap]:
        """The tensors of one block's MLP, the block's names starting with `at`."""
        gate_up, down = mlp
        return [
            TensorMap(at + "mlp.gate_proj.weight", (layer_weight(gate_up, "gate"),), transposed=True, kernel=True),
            TensorMap(at + "mlp.up_proj.weight", (layer_weight(gate_up, "up"),), transposed=True, kernel=True),
            TensorMap(at + "mlp.down_proj.weight", (layer_weight(down, "kernel"),), transposed=True, kernel=True),
        ]

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        (embed,) = m.prefix
        attn_norm, attn = m.blocks[0][:2]
        qwen2 = bool(args(attn, Attention).qkv_bias) and not args(attn, Attention).bias
        out: dict[str, object] = {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
            "vocab_size": args(embed, Embed).vocab,
            "hidden_size": args(embed, Embed).dim,
            "intermediate_size": _mlp_width(m.blocks[0][3]),
            "num_hidden_layers": len(m.blocks),
            "num_attention_heads": args(attn, Attention).heads,
            "num_key_value_heads": args(attn, Attention).kv_heads,
            "head_dim": args(attn, Attention).head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": args(attn_norm, RmsNorm).eps,
            "rope_theta": args(attn, Attention).rope_base,
            "max_position_embeddings": program.input(program.stream).type.shape[-1],
            "tie_word_embeddings": tied,
            "torch_dtype": dtype,
        }
        if not qwen2:
            out |= {"attention_bias": bool(args(attn, Attention).bias), "mlp_bias": False}
        return out

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        return self.keep_rotary(super().keep(written, original), written, original, {"rope_theta": "rope_theta"})


def _mlp_width(first: ir.Layer) -> int:
    """The hidden width of a block's MLP from its first layer: a SwiGLU's, or each expert's."""
    return args(first, MoE).hidden if first.kind == "moe" else args(first, SwiGLU).hidden


def _bias_facts(config: LlamaConfig, attn: ir.Layer) -> list[Fact]:
    """Qwen2 adds biases to q, k and v; a Llama with `attention_bias` to all four projections."""
    qkv, o = bool(args(attn, Attention).bias or args(attn, Attention).qkv_bias), bool(args(attn, Attention).bias)
    if isinstance(config, Qwen2MoeConfig):
        fix = "write `qkv_bias=true` on the attention" if config.qkv_bias else "leave out the attention's biases"
        return [
            Fact("qkv_bias", config.qkv_bias, qkv, "use of q, k and v biases", attn, "qkv_bias", fix),
            Fact("qkv_bias", False, o, "use of an o bias (never)", attn, None, "leave out `bias=true`"),
        ]
    if config.model_type == "qwen2":
        spec = "qwen2" if qkv and not o else "llama"
        fix = "write `qkv_bias=true` (and not `bias=true`) on the attention"
        return [
            Fact("model_type", "qwen2", spec, "model type, judged by its attention's biases,", attn, "qkv_bias", fix)
        ]
    fix = "write `bias=true` on the attention" if config.attention_bias else "leave the attention's biases out"
    return [
        Fact("attention_bias", config.attention_bias, qkv, "use of q, k and v biases", attn, "qkv_bias", fix),
        Fact("attention_bias", config.attention_bias, o, "use of an o bias", attn, None, fix),
    ]


def _window_facts(config: LlamaConfig, attn: ir.Layer, seq: int) -> list[Fact]:
    """The sliding window (Mistral; Qwen2 where `use_sliding_window`), where either side has
    one shorter than the spec's sequence: a window at least that long sees every earlier
    token, as attention without one does."""

    def within(window: object) -> object:
        return window if isinstance(window, int) and window < seq else None

    if within(config.window) == within(args(attn, Attention).window):
        return []
    fix = (
        f"write `window={config.window}` on the attention"
        if within(config.window) is not None
        else "leave out `window` on the attention"
    )
    return [Fact("sliding_window", config.window, args(attn, Attention).window, "sliding window", attn, None, fix)]


def _head_width_facts(config: LlamaConfig, embed: ir.Layer, attn: ir.Layer) -> list[Fact]:
    """A head's width, where either side gives it rather than leaving it to width // heads
    (which the width and heads facts check already)."""
    default = args(embed, Embed).dim // args(attn, Attention).heads
    if config.head_dim is None and args(attn, Attention).head_dim == default:
        return []
    fix = f"write `head_dim={config.head_width}` on the attention"
    return [Fact("head_dim", config.head_width, args(attn, Attention).head_dim, "head width", attn, "head_dim", fix)]


MIXTRAL_STRUCTURE = Structure(
    "Mixtral",
    ("embed",),
    ("(", "rmsnorm", "attention", ")", "(", "rmsnorm", "moe", ")"),
    ("rmsnorm", "linear"),
)


class Mixtral(Llama):
    """`MixtralForCausalLM`: Llama's layout with `block_sparse_moe` in place of the MLP — its
    router `gate` [experts, dim] and per expert `experts.{j}.w1` (gate), `w3` (up) and `w2`
    (down), nn.Linear weights [out, in] that stack into the spec's [experts, ...] matrices.
    The spec's `moe` must compute what Mixtral does: SwiGLU experts, no token dropped
    (`capacity=none`), gates renormalised over the chosen experts, no shared experts. Its
    load-balancing and z-loss weights are training choices, left to the spec."""

    name = "Mixtral"
    model_types: tuple[str, ...] = ("mixtral",)
    structure = MIXTRAL_STRUCTURE
    # Whether the family always renormalises its gates (else its config says, a fact).
    always_renormalised = True
    # Where a block's mixture is, and each expert's tensors with the spec's weight of each.
    moe_prefix = "block_sparse_moe."
    expert_tensors: tuple[tuple[str, str], ...] = (("w1", "w_gate"), ("w2", "w_out"), ("w3", "w_in"))

    def mlp_requirements(self, mlp: tuple[ir.Layer, ...]) -> list[Requirement]:
        (moe,) = mlp
        return [
            Requirement(
                moe, args(moe, MoE).activation == "swiglu", "its experts are SwiGLU", "write `activation=swiglu`"
            ),
            Requirement(moe, args(moe, MoE).capacity is None, "it drops no token", "write `capacity=none`"),
            Requirement(moe, not args(moe, MoE).balance, "its router has no balancing bias", "leave out `balance`"),
            *self.shared_requirements(moe),
        ] + (
            [
                Requirement(
                    moe, bool(args(moe, MoE).normalize), "its gates are renormalised", "leave out `normalize=false`"
                )
            ]
            if self.always_renormalised
            else []
        )

    def shared_requirements(self, moe: ir.Layer) -> list[Requirement]:
        return [Requirement(moe, not args(moe, MoE).shared, "it has no shared experts", "leave out `shared`")]

    def mlp_facts(self, config: LlamaConfig, mlp: tuple[ir.Layer, ...]) -> list[Fact]:
        assert isinstance(config, MixtralConfig)
        (moe,) = mlp
        return [
            Fact(
                "intermediate_size",
                config.intermediate_size,
                args(moe, MoE).hidden,
                "expert width",
                moe,
                "ffn",
                "change `hidden`",
            ),
            Fact(
                "num_local_experts",
                config.num_local_experts,
                args(moe, MoE).experts,
                "number of experts",
                moe,
                "experts",
                "change `experts`",
            ),
            Fact(
                "num_experts_per_tok",
                config.num_experts_per_tok,
                args(moe, MoE).top_k,
                "experts per token",
                moe,
                "top_k",
                "change `top_k`",
            ),
        ]

    def mlp_tensors(self, at: str, mlp: tuple[ir.Layer, ...]) -> list[TensorMap]:
        (moe,) = mlp
        at += self.moe_prefix
        out = [TensorMap(at + "gate.weight", (layer_weight(moe, "router"),), transposed=True, kernel=True)]
        for j in range(args(moe, MoE).experts):
            for name, weight in self.expert_tensors:
                out.append(
                    TensorMap(
                        f"{at}experts.{j}.{name}.weight",
                        (layer_weight(moe, weight),),
                        transposed=True,
                        kernel=True,
                        index=j,
                    )
                )
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        moe = m.blocks[0][3]
        out = super().config(m, program, tied, dtype)
        for key in ("attention_bias", "mlp_bias"):
            out.pop(key, None)
        return out | {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": args(moe, MoE).experts,
            "num_experts_per_tok": args(moe, MoE).top_k,
        }


QWEN3_MOE_STRUCTURE = Structure(
    "Qwen3-MoE", MIXTRAL_STRUCTURE.prefix, MIXTRAL_STRUCTURE.block, MIXTRAL_STRUCTURE.suffix
)


class Qwen3Moe(Mixtral):
    """`Qwen3MoeForCausalLM`: Mixtral's structure with Qwen's names — the router
    `mlp.gate` [experts, dim], per expert `mlp.experts.{j}.{gate,up,down}_proj` — and each
    head's query and key RMS-normalised (`self_attn.{q,k}_norm`, the attention's `qk_norm`,
    with the config's `rms_norm_eps`). Its gates are renormalised over the chosen experts
    only with `norm_topk_prob` (the `moe`'s `normalize`). Dense MLP layers between the sparse
    ones (`mlp_only_layers`, `decoder_sparse_step`) are not supported."""

    name = "Qwen3-MoE"
    model_types: tuple[str, ...] = ("qwen3_moe",)
    structure = QWEN3_MOE_STRUCTURE
    always_renormalised = False
    moe_prefix = "mlp."
    expert_tensors = (("gate_proj", "w_gate"), ("up_proj", "w_in"), ("down_proj", "w_out"))

    def qk_norm_requirement(self, attn: ir.Layer) -> Requirement:
        return Requirement(
            attn,
            bool(args(attn, Attention).qk_norm),
            "its attention normalises each head's query and key",
            "write `qk_norm=true`",
        )

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, Qwen3MoeConfig)
        out = super().facts(config, m, program)
        for block in m.blocks:
            attn, moe = block[1], block[3]
            a = args(attn, Attention)
            if a.qk_norm:
                out.append(
                    Fact("rms_norm_eps", config.rms_norm_eps, a.norm_eps, "query-key norm eps", attn, "eps",
                         "change the attention's `norm_eps`")
                )  # fmt: skip
            fix = "leave out `normalize=false`" if config.norm_topk_prob else "write `normalize=false`"
            out.append(
                Fact("norm_topk_prob", config.norm_topk_prob, args(moe, MoE).normalize, "renormalising of the gates",
                     moe, "normalize", fix)
            )  # fmt: skip
        return out

    def mlp_facts(self, config: LlamaConfig, mlp: tuple[ir.Layer, ...]) -> list[Fact]:
        assert isinstance(config, Qwen3MoeConfig)
        (moe,) = mlp
        return [
            Fact("moe_intermediate_size", config.moe_intermediate_size, args(moe, MoE).hidden, "expert width", moe,
                 "ffn", "change `hidden`"),
            Fact("num_experts", config.num_experts, args(moe, MoE).experts, "number of experts", moe, "experts",
                 "change `experts`"),
            Fact("num_experts_per_tok", config.num_experts_per_tok, args(moe, MoE).top_k, "experts per token", moe,
                 "top_k", "change `top_k`"),
        ]  # fmt: skip

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, Qwen3MoeConfig)
        out = super().unsupported(config, program)
        if config.mlp_only_layers or config.decoder_sparse_step != 1:
            out.append(
                (
                    "dense MLP layers between the sparse ones (mlp_only_layers, decoder_sparse_step)",
                    "dslc maps Qwen3-MoE checkpoints whose every layer is a mixture of experts",
                )
            )
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        moe = m.blocks[0][3]
        out = super().config(m, program, tied, dtype)
        for key in ("num_local_experts", "intermediate_size"):
            out.pop(key, None)
        return out | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": args(moe, MoE).hidden,
            "num_experts": args(moe, MoE).experts,
            "norm_topk_prob": bool(args(moe, MoE).normalize),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "attention_bias": False,
        }


QWEN2_MOE_STRUCTURE = Structure(
    "Qwen2-MoE", MIXTRAL_STRUCTURE.prefix, MIXTRAL_STRUCTURE.block, MIXTRAL_STRUCTURE.suffix
)


class Qwen2Moe(Qwen3Moe):
    """`Qwen2MoeForCausalLM`: Qwen3-MoE's names and experts with Qwen2's attention (q, k and v
    biases where `qkv_bias`, no query-key norm) and a shared expert every token passes —
    `mlp.shared_expert.{gate,up,down}_proj`, scaled by sigmoid(`mlp.shared_expert_gate` x)
    — the `moe`'s `shared` experts with `shared_router=true`."""

    name = "Qwen2-MoE"
    model_types: tuple[str, ...] = ("qwen2_moe",)
    structure = QWEN2_MOE_STRUCTURE

    def qk_norm_requirement(self, attn: ir.Layer) -> Requirement:
        return Llama.qk_norm_requirement(self, attn)

    def shared_requirements(self, moe: ir.Layer) -> list[Requirement]:
        return [
            Requirement(moe, bool(args(moe, MoE).shared), "it has a shared expert", "write `shared=...` (its width)"),
            Requirement(
                moe, bool(args(moe, MoE).shared_router), "its shared expert is gated", "write `shared_router=true`"
            ),
        ]

    def mlp_facts(self, config: LlamaConfig, mlp: tuple[ir.Layer, ...]) -> list[Fact]:
        assert isinstance(config, Qwen2MoeConfig)
        (moe,) = mlp
        shared = Fact(
            "shared_expert_intermediate_size",
            config.shared_expert_intermediate_size,
            args(moe, MoE).shared,
            "shared expert width",
            moe,
            "shared_ffn",
            "change `shared`",
        )
        return [*super().mlp_facts(config, mlp), shared]

    def mlp_tensors(self, at: str, mlp: tuple[ir.Layer, ...]) -> list[TensorMap]:
        (moe,) = mlp
        shared = at + "mlp.shared_expert"
        return [
            *super().mlp_tensors(at, mlp),
            TensorMap(f"{shared}.gate_proj.weight", (layer_weight(moe, "s_gate"),), transposed=True, kernel=True),
            TensorMap(f"{shared}.up_proj.weight", (layer_weight(moe, "s_in"),), transposed=True, kernel=True),
            TensorMap(f"{shared}.down_proj.weight", (layer_weight(moe, "s_out"),), transposed=True, kernel=True),
            TensorMap(f"{shared}_gate.weight", (layer_weight(moe, "s_router"),), transposed=True),
        ]

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        attn, moe = m.blocks[0][1], m.blocks[0][3]
        out = super().config(m, program, tied, dtype)
        out.pop("attention_bias", None)
        return out | {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "shared_expert_intermediate_size": args(moe, MoE).shared,
            "qkv_bias": bool(args(attn, Attention).qkv_bias or args(attn, Attention).bias),
        }
