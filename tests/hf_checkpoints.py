"""Small Hugging Face checkpoints written as `transformers` writes them, and the logits their
models compute, both without `transformers` or torch.

The checkpoints are config.json plus safetensors files with `save_pretrained`'s names and
layouts: GPT-2's Conv1D weights [in, out] with q, k and v fused in `c_attn`, Llama's
nn.Linear weights [out, in], GPT-NeoX's too with q, k and v fused head by head in
`query_key_value`, Gemma 2's norm weights the offsets of their scales from 1, a tied head
left out, ViT's patch embedding a Conv2d kernel [out, in, height, width], T5's one token
table `shared` and each stack's position bias table in its block 0. The forwards follow the
modelling code of `GPT2LMHeadModel`, `LlamaForCausalLM`, `MixtralForCausalLM`,
`Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM`, `GPTNeoXForCausalLM`, `Gemma2ForCausalLM`,
`ViTForImageClassification` and `T5ForConditionalGeneration` in float64 numpy, in its own
form where dslc's differs: the fused projection split after the product, rotary embeddings
as `rotate_half` with the frequencies repeated over both halves (on each head's first
`rotary_ndims` features alone for GPT-NeoX), key/value heads repeated with `repeat_kv`, a
-inf causal mask (and sliding window), ViT's images [batch, channels, height, width] and its
strided convolution a product of each patch with the kernel, T5's position buckets
`_relative_position_bucket` with torch's float32 arithmetic and its mask added to the bias.
Nothing here comes from dslc.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

Tensors = dict[str, np.ndarray]

GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    # Odd, like GPT-2's 50257: specs/gpt2.par's mesh pads it to split over `model`.
    "vocab_size": 95,
    "n_positions": 32,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "initializer_range": 0.02,
    "bos_token_id": 94,
    "eos_token_id": 94,
    "torch_dtype": "float32",
}
# The spec's constants that make specs/gpt2.par this size.
GPT2_SET = {"vocab": 95, "positions": 32, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8}

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}
LLAMA_SET = {"vocab": 96, "d": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "layers": 2, "seq": 16, "batch": 8}


MIXTRAL_CONFIG = {
    **{k: v for k, v in LLAMA_CONFIG.items() if k not in ("attention_bias", "mlp_bias")},
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "output_router_logits": False,
    "sliding_window": None,
    "rope_theta": 1000000.0,
}
MIXTRAL_SET = {
    "vocab": 96,
    "d": 32,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 48,
    "experts": 4,
    "layers": 2,
    "seq": 16,
    "batch": 8,
    "aux": 0.0,
}


QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Wider than hidden_size / num_attention_heads (8), as Qwen3's 128 is.
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "torch_dtype": "float32",
}
QWEN3_MOE_SET = {
    "vocab": 96,
    "d": 32,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "ffn": 48,
    "experts": 8,
    "layers": 2,
    "seq": 16,
    "batch": 8,
    "aux": 0.0,
}


QWEN2_MOE_CONFIG = {
    **{k: v for k, v in QWEN3_MOE_CONFIG.items() if k not in ("head_dim", "attention_bias")},
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "num_key_value_heads": 4,
    "shared_expert_intermediate_size": 40,
    "norm_topk_prob": False,
    "qkv_bias": True,
}
QWEN2_MOE_SET = {
    "vocab": 96,
    "d": 32,
    "heads": 4,
    "kv_heads": 4,
    "ffn": 48,
    "shared_ffn": 40,
    "experts": 8,
    "layers": 2,
    "seq": 16,
    "batch": 8,
    "aux": 0.0,
}


GPT_NEOX_CONFIG = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "hidden_act": "gelu",
    # Pythia's quarter of each head: 2 of its 8 features rotate.
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "max_position_embeddings": 64,
    "layer_norm_eps": 1e-5,
    "use_parallel_residual": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "use_cache": True,
    "torch_dtype": "float32",
}
# specs/gpt_neox.par derives `ffn = 4 * d` and `rope_dims = d // heads // 4` from these.
GPT_NEOX_SET = {"vocab": 96, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8}


GEMMA2_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Not hidden_size / num_attention_heads (8), as Gemma-2-2B's 256 is not 2304 / 8 (288).
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "query_pre_attn_scalar": 16,
    # Shorter than the tests' 16 tokens, so that the even layers see less than the odd ones.
    "sliding_window": 4,
    # Caps that bind at these sizes (Gemma 2's 50 and 30 barely touch small random weights'
    # scores and logits): a cap left out shows in the logits.
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "use_cache": True,
    "cache_implementation": "hybrid",
    "torch_dtype": "float32",
}
GEMMA2_SET = {
    "vocab": 96,
    "d": 32,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "ffn": 48,
    "layers": 4,
    "window": 4,
    "attn_cap": 2.0,
    "logit_cap": 3.0,
    "seq": 16,
    "batch": 8,
}


# The labels of the digits specs/vit.par learns, named as a dataset's id2label names them.
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
VIT_CONFIG = {
    "architectures": ["ViTForImageClassification"],
    "model_type": "vit",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "image_size": 16,
    "patch_size": 4,
    # Three channels, so that an image read with its channels in another order shows.
    "num_channels": 3,
    "qkv_bias": True,
    "encoder_stride": 4,
    "id2label": {str(i): name for i, name in enumerate(DIGITS)},
    "label2id": {name: i for i, name in enumerate(DIGITS)},
    "problem_type": "single_label_classification",
    "torch_dtype": "float32",
}
# specs/vit.par is 16x16 images, 4x4 patches, 4 heads, `ffn = 4 * d` and 10 classes already.
VIT_SET = {"channels": 3, "d": 32, "layers": 2, "batch": 8}


T5_CONFIG = {
    "architectures": ["T5ForConditionalGeneration"],
    "model_type": "t5",
    "vocab_size": 64,
    "d_model": 32,
    # Heads of 16: q, k, v [64, 32] and o [32, 64], not d_model / num_heads wide (as T5-11B's
    # 128 heads of 128 are not 1024 / 128), so that no projection is square.
    "d_kv": 16,
    "d_ff": 48,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    # Few buckets over 16 source tokens: the exact ones, the logarithmic ones and the last,
    # shared by the farthest keys, all occur.
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "is_encoder_decoder": True,
    "tie_word_embeddings": False,
    "use_cache": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "n_positions": 512,
    "torch_dtype": "float32",
}
# specs/t5.par at T5_CONFIG's sizes: 16 source tokens, 8 target tokens.
T5_SET = {
    "vocab": 64,
    "d": 32,
    "heads": 4,
    "head_dim": 16,
    "ffn": 48,
    "layers": 2,
    "buckets": 8,
    "max_distance": 16,
    "seq": 16,
    "target_seq": 8,
    "batch": 8,
}


def _normal(rng: np.random.Generator, *shape: int, scale: float = 0.1) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def gpt2_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """Random weights (biases and norms too, so that each one shows in the logits)."""
    rng = np.random.default_rng(seed)
    d, vocab, positions = int(config["n_embd"]), int(config["vocab_size"]), int(config["n_positions"])  # type: ignore[call-overload]
    inner = int(config["n_inner"] or 4 * d)  # type: ignore[call-overload]
    t: Tensors = {
        "transformer.wte.weight": _normal(rng, vocab, d),
        "transformer.wpe.weight": _normal(rng, positions, d),
    }
    for i in range(int(config["n_layer"])):  # type: ignore[call-overload]
        h = f"transformer.h.{i}."
        t |= {
            h + "ln_1.weight": 1 + _normal(rng, d),
            h + "ln_1.bias": _normal(rng, d),
            h + "attn.c_attn.weight": _normal(rng, d, 3 * d),
            h + "attn.c_attn.bias": _normal(rng, 3 * d),
            h + "attn.c_proj.weight": _normal(rng, d, d),
            h + "attn.c_proj.bias": _normal(rng, d),
            h + "ln_2.weight": 1 + _normal(rng, d),
            h + "ln_2.bias": _normal(rng, d),
            h + "mlp.c_fc.weight": _normal(rng, d, inner),
            h + "mlp.c_fc.bias": _normal(rng, inner),
            h + "mlp.c_proj.weight": _normal(rng, inner, d),
            h + "mlp.c_proj.bias": _normal(rng, d),
        }
    t |= {"transformer.ln_f.weight": 1 + _normal(rng, d), "transformer.ln_f.bias": _normal(rng, d)}
    if not config.get("tie_word_embeddings", True):
        t["lm_head.weight"] = _normal(rng, vocab, d)
    return t


def llama_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    rng = np.random.default_rng(seed)
    d, vocab, ffn = (int(config[k]) for k in ("hidden_size", "vocab_size", "intermediate_size"))  # type: ignore[call-overload]
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])  # type: ignore[call-overload]
    hd = int(config.get("head_dim") or d // heads)  # type: ignore[call-overload]
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias") or config.get("qkv_bias"))
    t: Tensors = {"model.embed_tokens.weight": _normal(rng, vocab, d)}
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"model.layers.{i}."
        t |= {
            at + "input_layernorm.weight": 1 + _normal(rng, d),
            at + "self_attn.q_proj.weight": _normal(rng, heads * hd, d),
            at + "self_attn.k_proj.weight": _normal(rng, kv * hd, d),
            at + "self_attn.v_proj.weight": _normal(rng, kv * hd, d),
            at + "self_attn.o_proj.weight": _normal(rng, d, heads * hd),
            at + "post_attention_layernorm.weight": 1 + _normal(rng, d),
            at + "mlp.gate_proj.weight": _normal(rng, ffn, d),
            at + "mlp.up_proj.weight": _normal(rng, ffn, d),
            at + "mlp.down_proj.weight": _normal(rng, d, ffn),
        }
        if qkv_bias:
            t |= {
                at + f"self_attn.{w}_proj.bias": _normal(rng, n * hd) for w, n in (("q", heads), ("k", kv), ("v", kv))
            }
        if config.get("attention_bias"):
            t[at + "self_attn.o_proj.bias"] = _normal(rng, d)
    t["model.norm.weight"] = 1 + _normal(rng, d)
    if not config.get("tie_word_embeddings", False):
        t["lm_head.weight"] = _normal(rng, vocab, d)
    return t


def mixtral_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """A Llama's tensors with each MLP replaced by `block_sparse_moe`: the router `gate`
    [experts, d] and per expert w1 (gate), w3 (up) [ffn, d] and w2 (down) [d, ffn]."""
    t = llama_tensors({**config, "model_type": "llama"}, seed)
    rng = np.random.default_rng(seed + 1000)
    d, ffn, experts = (int(config[k]) for k in ("hidden_size", "intermediate_size", "num_local_experts"))  # type: ignore[call-overload]
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"model.layers.{i}."
        for w in ("gate", "up", "down"):
            del t[at + f"mlp.{w}_proj.weight"]
        t[at + "block_sparse_moe.gate.weight"] = _normal(rng, experts, d, scale=0.5)
        for j in range(experts):
            e = f"{at}block_sparse_moe.experts.{j}."
            t |= {e + "w1.weight": _normal(rng, ffn, d), e + "w3.weight": _normal(rng, ffn, d)}
            t[e + "w2.weight"] = _normal(rng, d, ffn)
    return t


def qwen3_moe_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """A Llama's tensors with each head's query and key norms (`self_attn.{q,k}_norm`
    [head_dim]) and each MLP a mixture: the router `mlp.gate` [experts, d] and per expert
    `mlp.experts.{j}.{gate,up}_proj` [ffn, d] and `down_proj` [d, ffn]."""
    t = llama_tensors({**config, "model_type": "llama"}, seed)
    rng = np.random.default_rng(seed + 2000)
    d, ffn, experts = (int(config[k]) for k in ("hidden_size", "moe_intermediate_size", "num_experts"))  # type: ignore[call-overload]
    hd = int(config["head_dim"])  # type: ignore[call-overload]
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"model.layers.{i}."
        for w in ("gate", "up", "down"):
            del t[at + f"mlp.{w}_proj.weight"]
        t |= {
            at + "self_attn.q_norm.weight": 1 + _normal(rng, hd),
            at + "self_attn.k_norm.weight": 1 + _normal(rng, hd),
        }
        t[at + "mlp.gate.weight"] = _normal(rng, experts, d, scale=0.5)
        for j in range(experts):
            e = f"{at}mlp.experts.{j}."
            t |= {e + "gate_proj.weight": _normal(rng, ffn, d), e + "up_proj.weight": _normal(rng, ffn, d)}
            t[e + "down_proj.weight"] = _normal(rng, d, ffn)
    return t


def qwen2_moe_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """Qwen2's attention (q, k, v biases) with Qwen3-MoE's experts and, per layer, the shared
    expert `mlp.shared_expert.{gate,up,down}_proj` and its gate `mlp.shared_expert_gate` [1, d]."""
    t = llama_tensors({**config, "model_type": "qwen2"}, seed)
    rng = np.random.default_rng(seed + 3000)
    d, ffn, experts = (int(config[k]) for k in ("hidden_size", "moe_intermediate_size", "num_experts"))  # type: ignore[call-overload]
    shared = int(config["shared_expert_intermediate_size"])  # type: ignore[call-overload]
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"model.layers.{i}.mlp."
        for w in ("gate", "up", "down"):
            del t[at + f"{w}_proj.weight"]
        t[at + "gate.weight"] = _normal(rng, experts, d, scale=0.5)
        for j in range(experts):
            e = f"{at}experts.{j}."
            t |= {e + "gate_proj.weight": _normal(rng, ffn, d), e + "up_proj.weight": _normal(rng, ffn, d)}
            t[e + "down_proj.weight"] = _normal(rng, d, ffn)
        s = at + "shared_expert."
        t |= {s + "gate_proj.weight": _normal(rng, shared, d), s + "up_proj.weight": _normal(rng, shared, d)}
        t[s + "down_proj.weight"] = _normal(rng, d, shared)
        t[at + "shared_expert_gate.weight"] = _normal(rng, 1, d, scale=0.5)
    return t


def gpt_neox_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """GPT-NeoX's tensors: `attention.query_key_value` [3 d, d] holds q, k and v head by head
    (rows [heads, 3, head_dim]); the attention's biases only with `attention_bias` (its
    default true), the head `embed_out` only when untied."""
    rng = np.random.default_rng(seed)
    d, vocab, ffn = (int(config[k]) for k in ("hidden_size", "vocab_size", "intermediate_size"))  # type: ignore[call-overload]
    t: Tensors = {"gpt_neox.embed_in.weight": _normal(rng, vocab, d)}
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"gpt_neox.layers.{i}."
        t |= {
            at + "input_layernorm.weight": 1 + _normal(rng, d),
            at + "input_layernorm.bias": _normal(rng, d),
            at + "post_attention_layernorm.weight": 1 + _normal(rng, d),
            at + "post_attention_layernorm.bias": _normal(rng, d),
            at + "attention.query_key_value.weight": _normal(rng, 3 * d, d),
            at + "attention.dense.weight": _normal(rng, d, d),
            at + "mlp.dense_h_to_4h.weight": _normal(rng, ffn, d),
            at + "mlp.dense_h_to_4h.bias": _normal(rng, ffn),
            at + "mlp.dense_4h_to_h.weight": _normal(rng, d, ffn),
            at + "mlp.dense_4h_to_h.bias": _normal(rng, d),
        }
        if config.get("attention_bias", True):
            t |= {
                at + "attention.query_key_value.bias": _normal(rng, 3 * d),
                at + "attention.dense.bias": _normal(rng, d),
            }
    t |= {"gpt_neox.final_layer_norm.weight": 1 + _normal(rng, d), "gpt_neox.final_layer_norm.bias": _normal(rng, d)}
    if not config.get("tie_word_embeddings", False):
        t["embed_out.weight"] = _normal(rng, vocab, d)
    return t


def gemma2_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """Gemma 2's tensors: a Llama's attention and MLP names with four norms a layer
    (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
    `post_feedforward_layernorm`), each weight the offset of its scale from 1 (transformers
    initialises them at 0: here they are random, so that a scale read as the weight itself
    shows); `lm_head` only when untied."""
    rng = np.random.default_rng(seed)
    d, vocab, ffn = (int(config[k]) for k in ("hidden_size", "vocab_size", "intermediate_size"))  # type: ignore[call-overload]
    heads, kv, hd = (int(config[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))  # type: ignore[call-overload]
    t: Tensors = {"model.embed_tokens.weight": _normal(rng, vocab, d)}
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"model.layers.{i}."
        t |= {
            at + "input_layernorm.weight": _normal(rng, d, scale=0.3),
            at + "self_attn.q_proj.weight": _normal(rng, heads * hd, d, scale=0.2),
            at + "self_attn.k_proj.weight": _normal(rng, kv * hd, d, scale=0.2),
            at + "self_attn.v_proj.weight": _normal(rng, kv * hd, d),
            at + "self_attn.o_proj.weight": _normal(rng, d, heads * hd),
            at + "post_attention_layernorm.weight": _normal(rng, d, scale=0.3),
            at + "pre_feedforward_layernorm.weight": _normal(rng, d, scale=0.3),
            at + "mlp.gate_proj.weight": _normal(rng, ffn, d),
            at + "mlp.up_proj.weight": _normal(rng, ffn, d),
            at + "mlp.down_proj.weight": _normal(rng, d, ffn),
            at + "post_feedforward_layernorm.weight": _normal(rng, d, scale=0.3),
        }
        if config.get("attention_bias"):
            widths = {"q": heads * hd, "k": kv * hd, "v": kv * hd, "o": d}
            t |= {at + f"self_attn.{w}_proj.bias": _normal(rng, n) for w, n in widths.items()}
    t["model.norm.weight"] = _normal(rng, d, scale=0.3)
    if not config.get("tie_word_embeddings", True):
        t["lm_head.weight"] = _normal(rng, vocab, d)
    return t


def vit_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """ViTForImageClassification's tensors: the class token [1, 1, d] and the positions [1,
    patches + 1, d], the patch embedding a Conv2d [d, channels, patch, patch] with its bias,
    per layer q, k, v (biases where `qkv_bias`), the attention's output, the MLP and two
    layernorms, then the last layernorm and the classifier [labels, d]."""
    rng = np.random.default_rng(seed)
    d, ffn, channels = (int(config[k]) for k in ("hidden_size", "intermediate_size", "num_channels"))  # type: ignore[call-overload]
    side, patch = int(config["image_size"]), int(config["patch_size"])  # type: ignore[call-overload]
    labels = len(config["id2label"]) if "id2label" in config else int(config.get("num_labels", 2))  # type: ignore[arg-type, call-overload]
    emb = "vit.embeddings."
    t: Tensors = {
        emb + "cls_token": _normal(rng, 1, 1, d, scale=0.5),
        emb + "position_embeddings": _normal(rng, 1, (side // patch) ** 2 + 1, d, scale=0.5),
        emb + "patch_embeddings.projection.weight": _normal(rng, d, channels, patch, patch, scale=0.2),
        emb + "patch_embeddings.projection.bias": _normal(rng, d),
    }
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        at = f"vit.encoder.layer.{i}."
        t |= {
            at + "layernorm_before.weight": 1 + _normal(rng, d),
            at + "layernorm_before.bias": _normal(rng, d),
            at + "attention.attention.query.weight": _normal(rng, d, d, scale=0.2),
            at + "attention.attention.key.weight": _normal(rng, d, d, scale=0.2),
            at + "attention.attention.value.weight": _normal(rng, d, d),
            at + "attention.output.dense.weight": _normal(rng, d, d),
            at + "attention.output.dense.bias": _normal(rng, d),
            at + "layernorm_after.weight": 1 + _normal(rng, d),
            at + "layernorm_after.bias": _normal(rng, d),
            at + "intermediate.dense.weight": _normal(rng, ffn, d),
            at + "intermediate.dense.bias": _normal(rng, ffn),
            at + "output.dense.weight": _normal(rng, d, ffn),
            at + "output.dense.bias": _normal(rng, d),
        }
        if config.get("qkv_bias", True):
            t |= {at + f"attention.attention.{w}.bias": _normal(rng, d) for w in ("query", "key", "value")}
    t |= {"vit.layernorm.weight": 1 + _normal(rng, d), "vit.layernorm.bias": _normal(rng, d)}
    t |= {"classifier.weight": _normal(rng, labels, d, scale=0.3), "classifier.bias": _normal(rng, labels)}
    return t


def t5_tensors(config: dict[str, object], seed: int = 0) -> Tensors:
    """T5ForConditionalGeneration's tensors as save_pretrained writes them: `shared` once
    (the stacks' `embed_tokens` are it), each stack's blocks with their norms, attention
    (q, k, v [heads * d_kv, d], o [d, heads * d_kv]), block 0's `relative_attention_bias`
    [buckets, heads] and the gated MLP (wi_0, wi_1 [d_ff, d], wo [d, d_ff]), the decoder's
    cross-attention `EncDecAttention`, each stack's final norm, `lm_head` when untied. The
    bias tables are wide (scale 1) so that a bucket read from the wrong row shows."""
    rng = np.random.default_rng(seed)
    d, vocab, ffn, heads, kv = (int(config[k]) for k in ("d_model", "vocab_size", "d_ff", "num_heads", "d_kv"))  # type: ignore[call-overload]
    buckets = int(config["relative_attention_num_buckets"])  # type: ignore[call-overload]
    layers = int(config["num_layers"])  # type: ignore[call-overload]
    decoder_layers = int(config.get("num_decoder_layers") or layers)  # type: ignore[call-overload]
    inner = heads * kv

    def attention(at: str) -> Tensors:
        return {
            at + "q.weight": _normal(rng, inner, d, scale=0.2),
            at + "k.weight": _normal(rng, inner, d, scale=0.2),
            at + "v.weight": _normal(rng, inner, d),
            at + "o.weight": _normal(rng, d, inner),
        }

    def mlp(at: str) -> Tensors:
        return {
            at + "wi_0.weight": _normal(rng, ffn, d),
            at + "wi_1.weight": _normal(rng, ffn, d),
            at + "wo.weight": _normal(rng, d, ffn),
        }

    t: Tensors = {"shared.weight": _normal(rng, vocab, d, scale=1.0)}
    for stack, count, parts in (("encoder", layers, 2), ("decoder", decoder_layers, 3)):
        for i in range(count):
            at = f"{stack}.block.{i}.layer."
            t |= {at + "0.layer_norm.weight": 1 + _normal(rng, d), **attention(at + "0.SelfAttention.")}
            if i == 0:
                t[at + "0.SelfAttention.relative_attention_bias.weight"] = _normal(rng, buckets, heads, scale=1.0)
            if parts == 3:
                t |= {at + "1.layer_norm.weight": 1 + _normal(rng, d), **attention(at + "1.EncDecAttention.")}
            t |= {f"{at}{parts - 1}.layer_norm.weight": 1 + _normal(rng, d), **mlp(f"{at}{parts - 1}.DenseReluDense.")}
        t[f"{stack}.final_layer_norm.weight"] = 1 + _normal(rng, d)
    if not config.get("tie_word_embeddings", True):
        t["lm_head.weight"] = _normal(rng, vocab, d)
    return t


def write_checkpoint(folder: Path, config: dict[str, object], tensors: Tensors, shards: int = 1) -> Path:
    """config.json and one model.safetensors, or `shards` files with their index, as
    `save_pretrained` names them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


# ---- the models' forward passes ------------------------------------------------------------------


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _causal_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    window: int | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """q, k, v [b, heads, s, hd] -> [b, s, heads * hd]; with `window`, query i sees keys
    i - window + 1 ... i (Mistral's sliding window, Gemma 2's on its even layers). The scores
    are multiplied by `scaling` (1 / sqrt(hd) unless given) and, with `softcap`, capped at
    softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    s, hd = q.shape[2], q.shape[3]
    scores = q @ k.transpose(0, 1, 3, 2) * (scaling if scaling is not None else 1 / math.sqrt(hd))
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    seen = np.tril(np.ones((s, s), bool))
    if window is not None:
        seen &= ~np.tril(np.ones((s, s), bool), -window)
    scores = np.where(seen, scores, -np.inf)
    out = _softmax(scores) @ v
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], s, -1)


def gpt2_logits(config: dict[str, object], tensors: Tensors, ids: np.ndarray) -> np.ndarray:
    t = {name.removeprefix("transformer."): value.astype(np.float64) for name, value in tensors.items()}
    heads, eps = int(config["n_head"]), float(config["layer_norm_epsilon"])  # type: ignore[call-overload, arg-type]
    b, s = ids.shape
    x = t["wte.weight"][ids] + t["wpe.weight"][np.arange(s)]
    for i in range(int(config["n_layer"])):  # type: ignore[call-overload]
        p = f"h.{i}."
        h = _layernorm(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        q, k, v = (part.reshape(b, s, heads, -1).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1))
        x = x + _causal_attention(q, k, v) @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        h = _layernorm(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        h = h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]
        h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))  # gelu_new
        x = x + h @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    x = _layernorm(x, t["ln_f.weight"], t["ln_f.bias"], eps)
    head = t.get("lm_head.weight", t["wte.weight"])
    return x @ head.T


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def llama_logits(config: dict[str, object], tensors: Tensors, ids: np.ndarray) -> np.ndarray:
    t = {name.removeprefix("model."): value.astype(np.float64) for name, value in tensors.items()}
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])  # type: ignore[call-overload]
    eps, theta = float(config["rms_norm_eps"]), float(config["rope_theta"])  # type: ignore[arg-type]
    b, s = ids.shape
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // heads)  # type: ignore[call-overload]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(s), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]
    x = t["embed_tokens.weight"][ids]
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)

        def project(name: str, n: int, h: np.ndarray = h, p: str = p) -> np.ndarray:
            y = h @ t[p + f"self_attn.{name}_proj.weight"].T
            y = y + t[p + f"self_attn.{name}_proj.bias"] if p + f"self_attn.{name}_proj.bias" in t else y
            return y.reshape(b, s, n, hd).transpose(0, 2, 1, 3)

        q, k, v = project("q", heads), project("k", kv), project("v", kv)
        if p + "self_attn.q_norm.weight" in t:
            # Qwen3: each head's query and key RMS-normalised ([b, n, s, hd], over hd).
            q, k = _rms(q, t[p + "self_attn.q_norm.weight"], eps), _rms(k, t[p + "self_attn.k_norm.weight"], eps)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # repeat_kv: key/value head j serves query heads j * group ... (j + 1) * group - 1.
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        window = config.get("sliding_window") if config.get("model_type") == "mistral" else None
        o = _causal_attention(q, k, v, window) @ t[p + "self_attn.o_proj.weight"].T  # type: ignore[arg-type]
        x = x + (o + t[p + "self_attn.o_proj.bias"] if p + "self_attn.o_proj.bias" in t else o)
        h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        if p + "block_sparse_moe.gate.weight" in t:
            x = x + _sparse_moe(config, t, p + "block_sparse_moe.", h, ("w1", "w3", "w2"), True)
            continue
        if p + "mlp.gate.weight" in t:
            names = ("gate_proj", "up_proj", "down_proj")
            x = x + _sparse_moe(config, t, p + "mlp.", h, names, bool(config.get("norm_topk_prob")))
            continue
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    x = _rms(x, t["norm.weight"], eps)
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).astype(np.float64)
    return x @ head.T


def _sparse_moe(
    config: dict[str, object], t: Tensors, p: str, h: np.ndarray, names: tuple[str, str, str], renormalise: bool
) -> np.ndarray:
    """MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock: each token's router softmax, its top k,
    their weights (renormalised to sum to 1 where `renormalise`), and each chosen expert's
    down(silu(gate x) * up x) weighted so (`names`: gate, up, down); every token reaches its
    experts (nothing is dropped)."""
    gate_name, up_name, down_name = names
    k = int(config["num_experts_per_tok"])  # type: ignore[call-overload]
    probs = _softmax(h @ t[p + "gate.weight"].T)  # [b, s, experts]
    chosen = np.argsort(-probs, axis=-1)[..., :k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for j in range(probs.shape[-1]):
        e = f"{p}experts.{j}."
        gate, up = h @ t[e + f"{gate_name}.weight"].T, h @ t[e + f"{up_name}.weight"].T
        y = (gate / (1.0 + np.exp(-gate)) * up) @ t[e + f"{down_name}.weight"].T
        out += np.where(chosen == j, weights, 0.0).sum(-1, keepdims=True) * y
    if p + "shared_expert_gate.weight" in t:
        # Qwen2MoeSparseMoeBlock: the shared expert, scaled by its sigmoid gate, added.
        s = p + "shared_expert."
        gate, up = h @ t[s + "gate_proj.weight"].T, h @ t[s + "up_proj.weight"].T
        y = (gate / (1.0 + np.exp(-gate)) * up) @ t[s + "down_proj.weight"].T
        out += y / (1.0 + np.exp(-(h @ t[p + "shared_expert_gate.weight"].T)))
    return out


def _gelu(x: np.ndarray, hidden_act: str) -> np.ndarray:
    """ACT2FN's GELUs: `gelu` the exact one (erf), `gelu_new` and `gelu_pytorch_tanh` the tanh form."""
    if hidden_act in ("gelu_new", "gelu_pytorch_tanh"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    assert hidden_act == "gelu"
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def gpt_neox_logits(config: dict[str, object], tensors: Tensors, ids: np.ndarray) -> np.ndarray:
    """GPTNeoXForCausalLM with `use_parallel_residual`: x + attn(ln_1(x)) + mlp(ln_2(x))."""
    assert config.get("use_parallel_residual", True)
    t = {name.removeprefix("gpt_neox."): value.astype(np.float64) for name, value in tensors.items()}
    heads, eps = int(config["num_attention_heads"]), float(config["layer_norm_eps"])  # type: ignore[call-overload, arg-type]
    base = float(config.get("rotary_emb_base", 10000))  # type: ignore[arg-type]
    b, s = ids.shape
    hd = int(config["hidden_size"]) // heads  # type: ignore[call-overload]
    rotary_ndims = int(hd * float(config.get("rotary_pct", 0.25)))  # type: ignore[arg-type]
    inv_freq = 1.0 / base ** (np.arange(0, rotary_ndims, 2) / rotary_ndims)
    freqs = np.outer(np.arange(s), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]

    def rotate(x: np.ndarray) -> np.ndarray:
        """The first rotary_ndims features of each head rotated, the rest passed."""
        rot, rest = x[..., :rotary_ndims], x[..., rotary_ndims:]
        return np.concatenate([rot * cos + _rotate_half(rot) * sin, rest], axis=-1)

    x = t["embed_in.weight"][ids]
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"layers.{i}."

        def linear(name: str, h: np.ndarray, p: str = p) -> np.ndarray:
            y = h @ t[p + name + ".weight"].T
            return y + t[p + name + ".bias"] if p + name + ".bias" in t else y

        h = _layernorm(x, t[p + "input_layernorm.weight"], t[p + "input_layernorm.bias"], eps)
        # [b, s, 3 d] viewed as [b, s, heads, 3 head_dim], then cut in three: q, k, v of each head.
        qkv = linear("attention.query_key_value", h).reshape(b, s, heads, 3 * hd).transpose(0, 2, 1, 3)
        q, k, v = np.split(qkv, 3, axis=-1)
        attn = linear("attention.dense", _causal_attention(rotate(q), rotate(k), v))
        h = _layernorm(x, t[p + "post_attention_layernorm.weight"], t[p + "post_attention_layernorm.bias"], eps)
        mlp = linear("mlp.dense_4h_to_h", _gelu(linear("mlp.dense_h_to_4h", h), str(config["hidden_act"])))
        x = x + attn + mlp
    x = _layernorm(x, t["final_layer_norm.weight"], t["final_layer_norm.bias"], eps)
    head = tensors.get("embed_out.weight", tensors["gpt_neox.embed_in.weight"]).astype(np.float64)
    return x @ head.T


def gemma2_logits(config: dict[str, object], tensors: Tensors, ids: np.ndarray) -> np.ndarray:
    """Gemma2ForCausalLM: the embedding times sqrt(hidden_size) rounded to the hidden states'
    dtype (float32 here, the checkpoint's), RMSNorms that scale by 1 + their weight, each
    branch's output normed too before it is added, scores scaled by query_pre_attn_scalar **
    -0.5 and capped, a sliding window on the layers `layer_types` says (the even ones when
    left out), GeGLU with the tanh GELU, the final logits capped."""
    t = {name.removeprefix("model."): value.astype(np.float64) for name, value in tensors.items()}
    d, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])  # type: ignore[call-overload]
    heads, kv, hd = (int(config[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))  # type: ignore[call-overload]
    eps, theta = float(config["rms_norm_eps"]), float(config["rope_theta"])  # type: ignore[arg-type]
    scaling = float(config["query_pre_attn_scalar"]) ** -0.5  # type: ignore[arg-type]
    attn_cap, logit_cap = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    kinds = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    b, s = ids.shape
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(s), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + t[name + ".weight"])

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    x = t["embed_tokens.weight"][ids] * np.float64(np.float32(math.sqrt(d)))
    for i in range(layers):
        p = f"layers.{i}."
        h = norm(x, p + "input_layernorm")
        q, k, v = (
            linear(h, p + f"self_attn.{name}_proj").reshape(b, s, n, hd).transpose(0, 2, 1, 3)
            for name, n in (("q", heads), ("k", kv), ("v", kv))
        )
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # repeat_kv
        window = int(config["sliding_window"]) if kinds[i] == "sliding_attention" else None  # type: ignore[call-overload]
        o = _causal_attention(q, k, v, window, scaling, attn_cap)  # type: ignore[arg-type]
        x = x + norm(linear(o, p + "self_attn.o_proj"), p + "post_attention_layernorm")
        h = norm(x, p + "pre_feedforward_layernorm")
        h = _gelu(linear(h, p + "mlp.gate_proj"), str(config["hidden_activation"])) * linear(h, p + "mlp.up_proj")
        x = x + norm(linear(h, p + "mlp.down_proj"), p + "post_feedforward_layernorm")
    x = norm(x, "norm")
    logits = x @ t.get("lm_head.weight", t["embed_tokens.weight"]).T
    if logit_cap is not None:
        logits = logit_cap * np.tanh(logits / logit_cap)  # type: ignore[operator]
    return logits


def vit_logits(config: dict[str, object], tensors: Tensors, pixel_values: np.ndarray) -> np.ndarray:
    """ViTForImageClassification on `pixel_values` [batch, channels, height, width], as
    transformers takes them: the Conv2d of the patch embedding written as what it is with a
    stride of its size and no padding, each patch's channels x rows x columns dotted with the
    kernel's, the patches taken row by row (`flatten(2).transpose(1, 2)`); the class token
    before them, the positions added (no interpolation: the image must be `image_size`);
    pre-norm layers whose attention masks nothing; the classifier on the class token's vector
    after the last layernorm."""
    t = {name: value.astype(np.float64) for name, value in tensors.items()}
    d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])  # type: ignore[call-overload]
    eps, patch, act = float(config["layer_norm_eps"]), int(config["patch_size"]), str(config["hidden_act"])  # type: ignore[arg-type, call-overload]
    b, c, h, w = pixel_values.shape
    assert h == w == int(config["image_size"]), "transformers refuses another size unless it interpolates"  # type: ignore[call-overload]
    rows, cols = h // patch, w // patch
    x = pixel_values.astype(np.float64).reshape(b, c, rows, patch, cols, patch)
    patches = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, rows * cols, c * patch * patch)
    emb = "vit.embeddings."
    kernel = t[emb + "patch_embeddings.projection.weight"].reshape(d, c * patch * patch)
    x = patches @ kernel.T + t[emb + "patch_embeddings.projection.bias"]
    x = np.concatenate([np.broadcast_to(t[emb + "cls_token"], (b, 1, d)), x], axis=1)
    x = x + t[emb + "position_embeddings"]
    s, hd = x.shape[1], d // heads

    def linear(name: str, h: np.ndarray) -> np.ndarray:
        y = h @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"vit.encoder.layer.{i}."
        hid = _layernorm(x, t[p + "layernorm_before.weight"], t[p + "layernorm_before.bias"], eps)
        q, k, v = (
            linear(f"{p}attention.attention.{name}", hid).reshape(b, s, heads, hd).transpose(0, 2, 1, 3)
            for name in ("query", "key", "value")
        )
        probs = _softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd))
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = x + linear(p + "attention.output.dense", context)
        hid = _layernorm(x, t[p + "layernorm_after.weight"], t[p + "layernorm_after.bias"], eps)
        x = x + linear(p + "output.dense", _gelu(linear(p + "intermediate.dense", hid), act))
    x = _layernorm(x, t["vit.layernorm.weight"], t["vit.layernorm.bias"], eps)
    return linear("classifier", x[:, 0])


def _t5_buckets(relative: np.ndarray, bidirectional: bool, buckets: int, max_distance: int) -> np.ndarray:
    """T5Attention._relative_position_bucket on key - query distances, its arithmetic in
    float32 as torch's (`relative_position.float()`, a float32 log, truncated to long)."""
    out = np.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out += (relative > 0).astype(relative.dtype) * buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    exact = buckets // 2
    # log(0) and its cast are computed where `relative` is small, as torch computes them, and
    # never used (the `where` below takes `relative` itself there).
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log(relative.astype(np.float32) / np.float32(exact)) / np.float32(math.log(max_distance / exact))
        large = exact + (ratio * np.float32(buckets - exact)).astype(np.int64)
    large = np.minimum(large, buckets - 1)
    return out + np.where(relative < exact, relative, large)


def t5_logits(
    config: dict[str, object], tensors: Tensors, input_ids: np.ndarray, decoder_input_ids: np.ndarray
) -> np.ndarray:
    """T5ForConditionalGeneration: the encoder over `input_ids`, the decoder over
    `decoder_input_ids` attending to the encoder's output, the logits `lm_head` of the
    decoder's last norm (scaled by d_model ** -0.5 first where the head is tied). Scores are
    q·k unscaled plus each stack's position bias (block 0's table, for every block; the
    decoder's buckets one-way, its causal mask added to it); the cross-attention adds none.
    T5LayerNorm is x / sqrt(mean(x²) + eps) * weight, with no mean taken and no bias."""
    t = {name: value.astype(np.float64) for name, value in tensors.items()}
    heads, kv, eps = int(config["num_heads"]), int(config["d_kv"]), float(config["layer_norm_epsilon"])  # type: ignore[call-overload, arg-type]
    buckets, distance = int(config["relative_attention_num_buckets"]), int(config["relative_attention_max_distance"])  # type: ignore[call-overload]
    layers = int(config["num_layers"])  # type: ignore[call-overload]
    decoder_layers = int(config.get("num_decoder_layers") or layers)  # type: ignore[call-overload]
    projection = str(config["feed_forward_proj"])
    act = "gelu_new" if projection == "gated-gelu" else projection.split("-")[-1]

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * t[name + ".weight"]

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ t[name + ".weight"].T

    def bias(stack: str, length: int, bidirectional: bool) -> np.ndarray:
        relative = np.arange(length)[None, :] - np.arange(length)[:, None]  # memory - context
        bucket = _t5_buckets(relative, bidirectional, buckets, distance)
        values = t[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"][bucket]  # [q, k, heads]
        return values.transpose(2, 0, 1)[None]

    def attention(x: np.ndarray, memory: np.ndarray, name: str, position_bias: np.ndarray | float) -> np.ndarray:
        def heads_of(y: np.ndarray) -> np.ndarray:
            return y.reshape(y.shape[0], y.shape[1], heads, kv).transpose(0, 2, 1, 3)

        q, k, v = (
            heads_of(linear(x, name + ".q")),
            heads_of(linear(memory, name + ".k")),
            heads_of(linear(memory, name + ".v")),
        )
        scores = q @ k.transpose(0, 1, 3, 2) + position_bias
        out = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], heads * kv)
        return linear(out, name + ".o")

    def mlp(x: np.ndarray, name: str) -> np.ndarray:
        gate = linear(x, name + ".wi_0")
        gate = gate / (1.0 + np.exp(-gate)) if act == "silu" else _gelu(gate, act)
        return linear(gate * linear(x, name + ".wi_1"), name + ".wo")

    x = t["shared.weight"][input_ids]
    encoder_bias = bias("encoder", x.shape[1], True)
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        h = norm(x, p + "0.layer_norm")
        x = x + attention(h, h, p + "0.SelfAttention", encoder_bias)
        x = x + mlp(norm(x, p + "1.layer_norm"), p + "1.DenseReluDense")
    encoded = norm(x, "encoder.final_layer_norm")
    y = t["shared.weight"][decoder_input_ids]
    s = y.shape[1]
    decoder_bias = bias("decoder", s, False) + np.where(np.tril(np.ones((s, s), bool)), 0.0, -np.inf)
    for i in range(decoder_layers):
        p = f"decoder.block.{i}.layer."
        h = norm(y, p + "0.layer_norm")
        y = y + attention(h, h, p + "0.SelfAttention", decoder_bias)
        y = y + attention(norm(y, p + "1.layer_norm"), encoded, p + "1.EncDecAttention", 0.0)
        y = y + mlp(norm(y, p + "2.layer_norm"), p + "2.DenseReluDense")
    y = norm(y, "decoder.final_layer_norm")
    if config.get("tie_word_embeddings", True):
        return y * float(config["d_model"]) ** -0.5 @ t["shared.weight"].T  # type: ignore[arg-type]
    return y @ t["lm_head.weight"].T
