"""A Hugging Face checkpoint's `config.json`, read into validated models.

Only the fields that decide what the weights compute are read; every other key is ignored.
Values are checked strictly (an integer where an integer is meant, `true`/`false` for flags),
with the defaults `transformers` itself gives a key that is left out. A config that is not
JSON, names a `model_type` dslc cannot map, or holds a value of the wrong kind is a
`CheckpointError` that says which key and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)

from dslc.interop.errors import file_problem

CONFIG = "config.json"


class _Config(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class GPT2Config(_Config):
    """`GPT2LMHeadModel`: learned positions, pre-norm blocks, Conv1D projections, a tied head."""

    model_type: Literal["gpt2"]
    vocab_size: PositiveInt = 50257
    n_positions: PositiveInt = 1024
    n_embd: PositiveInt = 768
    n_layer: PositiveInt = 12
    n_head: PositiveInt = 12
    n_inner: PositiveInt | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: PositiveFloat = 1e-5
    tie_word_embeddings: bool = True
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False

    @property
    def ffn(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd


class LlamaConfig(_Config):
    """`LlamaForCausalLM` and the models built like it: Mistral (with a sliding window) and
    Qwen2 (with biases on q, k and v)."""

    model_type: Literal["llama", "mistral", "qwen2"]
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    hidden_act: str = "silu"
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    # transformers 4 writes `rope_scaling`, 5 writes `rope_parameters` (with the theta in it).
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: PositiveInt | None = None
    use_sliding_window: bool = False
    max_position_embeddings: PositiveInt = 2048

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_base(self) -> float:
        if self.rope_parameters is not None and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return self.rope_theta

    @property
    def rope_type(self) -> str:
        """ "default" for plain rotary embeddings; otherwise the scaling the config asks for."""
        return _rope_type(self.rope_parameters, self.rope_scaling)

    @property
    def window(self) -> int | None:
        """The sliding window attention is limited to, if any."""
        if self.model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not self.use_sliding_window:
            return None
        return self.sliding_window


class MixtralConfig(LlamaConfig):
    """`MixtralForCausalLM`: a Mistral whose MLPs are sparse mixtures of SwiGLU experts
    (`num_local_experts`, each token to `num_experts_per_tok` of them, gates renormalised
    over those, no token dropped)."""

    model_type: Literal["mixtral"]  # type: ignore[assignment]
    num_local_experts: PositiveInt = 8
    num_experts_per_tok: PositiveInt = 2
    router_jitter_noise: float = 0.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    rms_norm_eps: PositiveFloat = 1e-5


class Qwen3MoeConfig(LlamaConfig):
    """`Qwen3MoeForCausalLM`: Llama's layout with each head's query and key RMS-normalised
    (`q_norm`, `k_norm`), a head width of its own (`head_dim`), and sparse mixtures of
    SwiGLU experts (`num_experts`, each token to `num_experts_per_tok` of them, the gates
    renormalised only with `norm_topk_prob`) of width `moe_intermediate_size`. Its defaults
    are transformers' (Qwen3-30B-A3B's sizes)."""

    model_type: Literal["qwen3_moe"]  # type: ignore[assignment]
    vocab_size: PositiveInt = 151936
    hidden_size: PositiveInt = 2048
    intermediate_size: PositiveInt = 6144
    num_hidden_layers: PositiveInt = 24
    num_attention_heads: PositiveInt = 32
    num_key_value_heads: PositiveInt | None = 4
    rms_norm_eps: PositiveFloat = 1e-6
    max_position_embeddings: PositiveInt = 32768
    moe_intermediate_size: PositiveInt = 768
    num_experts: PositiveInt = 128
    num_experts_per_tok: PositiveInt = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: list[int] | None = None
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False


class Qwen2MoeConfig(Qwen3MoeConfig):
    """`Qwen2MoeForCausalLM`: Qwen2's attention (biases on q, k and v where `qkv_bias`, no
    query-key norm) and Qwen3-MoE's experts, plus a shared expert of width
    `shared_expert_intermediate_size` every token passes, scaled by a sigmoid gate. Its
    defaults are transformers' (Qwen1.5-MoE-A2.7B's sizes)."""

    model_type: Literal["qwen2_moe"]  # type: ignore[assignment]
    intermediate_size: PositiveInt = 5632
    num_attention_heads: PositiveInt = 16
    num_key_value_heads: PositiveInt | None = 16
    moe_intermediate_size: PositiveInt = 1408
    shared_expert_intermediate_size: PositiveInt = 5632
    num_experts: PositiveInt = 60
    num_experts_per_tok: PositiveInt = 4
    qkv_bias: bool = True


class GPTNeoXConfig(_Config):
    """`GPTNeoXForCausalLM` (Pythia): pre-norm blocks whose attention and MLP read the same
    input (`use_parallel_residual`), q, k and v fused head by head, rotary embeddings on the
    first `rotary_pct` of each head's features, an untied head `embed_out`.

    transformers 4 writes the rotary base and share as `rotary_emb_base` and `rotary_pct`
    (its later releases also as `rope_theta` and `partial_rotary_factor`), 5 in
    `rope_parameters`; `rope_base` and `rotary_share` read them in the order transformers
    does, the newest first."""

    model_type: Literal["gpt_neox"]
    vocab_size: PositiveInt = 50432
    hidden_size: PositiveInt = 6144
    num_hidden_layers: PositiveInt = 44
    num_attention_heads: PositiveInt = 64
    intermediate_size: PositiveInt = 24576
    hidden_act: str = "gelu"
    rotary_pct: PositiveFloat | None = None
    partial_rotary_factor: PositiveFloat | None = None
    rotary_emb_base: PositiveFloat | None = None
    rope_theta: PositiveFloat | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: PositiveInt = 2048
    layer_norm_eps: PositiveFloat = 1e-5
    use_parallel_residual: bool = True
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    @property
    def head_width(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_base(self) -> float:
        if self.rope_parameters is not None and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return next((b for b in (self.rotary_emb_base, self.rope_theta) if b is not None), 10000.0)

    @property
    def rotary_share(self) -> float:
        """The share of each head's features that rotate (transformers' default a quarter)."""
        if self.rope_parameters is not None and "partial_rotary_factor" in self.rope_parameters:
            return float(self.rope_parameters["partial_rotary_factor"])
        return next((p for p in (self.rotary_pct, self.partial_rotary_factor) if p is not None), 0.25)

    @property
    def rotary_dims(self) -> int:
        """How many of each head's features rotate, as transformers counts them: the share's,
        rounded down."""
        return int(self.head_width * self.rotary_share)

    @property
    def rope_type(self) -> str:
        return _rope_type(self.rope_parameters, self.rope_scaling)


class Gemma2Config(_Config):
    """`Gemma2ForCausalLM`: a Llama-like decoder whose embedding is scaled by sqrt(hidden_size),
    whose RMSNorms scale by 1 + their weight and also norm each branch's output, with a GeGLU
    MLP (`hidden_activation`), attention scores scaled by `query_pre_attn_scalar` ** -0.5 and
    capped at `attn_logit_softcapping`, its even layers attending within `sliding_window`
    and its odd ones to every earlier token (`layer_types`, left out as a rule), and the final
    logits capped at `final_logit_softcapping`. Its defaults are transformers' (Gemma-2-2B's
    sizes); the rotary base is read as LlamaConfig reads it."""

    model_type: Literal["gemma2"]
    vocab_size: PositiveInt = 256000
    hidden_size: PositiveInt = 2304
    intermediate_size: PositiveInt = 9216
    num_hidden_layers: PositiveInt = 26
    num_attention_heads: PositiveInt = 8
    num_key_value_heads: PositiveInt = 4
    head_dim: PositiveInt = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: PositiveInt = 8192
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: PositiveFloat = 256
    sliding_window: PositiveInt = 4096
    layer_types: list[str] | None = None
    attn_logit_softcapping: PositiveFloat | None = 50.0
    final_logit_softcapping: PositiveFloat | None = 30.0
    use_bidirectional_attention: bool | None = None

    @property
    def rope_base(self) -> float:
        if self.rope_parameters is not None and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return self.rope_theta

    @property
    def rope_type(self) -> str:
        return _rope_type(self.rope_parameters, self.rope_scaling)


def _side(value: object) -> int | list[int]:
    """An image's or a patch's size as transformers takes it: one side for a square, or
    [height, width]; a ValueError (said in the C004 of the key) otherwise."""

    def positive(v: object) -> bool:
        return type(v) is int and v > 0  # not a bool, which is an int to Python

    if positive(value):
        return value  # type: ignore[return-value]
    if isinstance(value, list) and len(value) == 2 and all(positive(v) for v in value):
        return value
    raise ValueError("should be a positive integer, or [height, width]")


Side = Annotated[int | list[int], PlainValidator(_side)]


class ViTConfig(_Config):
    """`ViTForImageClassification`: an image of `num_channels` channels cut into
    `patch_size` patches by a strided Conv2d, a class token before them and learned
    positions added, pre-norm encoder layers (attention that looks both ways, biases on q, k
    and v where `qkv_bias`, an MLP with `hidden_act`), a final layernorm, and a classifier on
    the class token's vector with as many outputs as `id2label` names labels (or
    `num_labels`; transformers' default is 2, which `save_pretrained` leaves out). Its
    defaults are transformers' (ViT-B/16's sizes). `architectures`, where given, says which of
    the ViT heads the weights are for."""

    model_type: Literal["vit"]
    architectures: list[str] | None = None
    hidden_size: PositiveInt = 768
    num_hidden_layers: PositiveInt = 12
    num_attention_heads: PositiveInt = 12
    intermediate_size: PositiveInt = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: PositiveFloat = 1e-12
    image_size: Side = 224
    patch_size: Side = 16
    num_channels: PositiveInt = 3
    qkv_bias: bool = True
    id2label: dict[str, str] | None = None
    # 0 is transformers' way of asking for no classifier, which `ViT.unsupported` refuses.
    num_labels: NonNegativeInt | None = None

    @property
    def image(self) -> tuple[int, int]:
        """The image's height and width (transformers reads a single number as a square)."""
        return _pair(self.image_size)

    @property
    def patch(self) -> tuple[int, int]:
        return _pair(self.patch_size)

    @property
    def labels(self) -> int:
        """How many outputs the classifier has."""
        if self.id2label is not None:
            return len(self.id2label)
        return self.num_labels if self.num_labels is not None else 2


def _feed_forward(value: object) -> str:
    """T5's `feed_forward_proj` as transformers takes it: an activation's name, gated or not
    (`relu`, `gated-gelu`); a ValueError (said in the C004 of the key) otherwise, which
    transformers raises too."""
    if not isinstance(value, str):
        raise ValueError("should be a string")
    parts = value.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or not all(parts):
        raise ValueError("should be an activation's name, or `gated-` and one (`relu`, `gated-gelu`)")
    return value


FeedForward = Annotated[str, PlainValidator(_feed_forward)]


class T5Config(_Config):
    """`T5ForConditionalGeneration`: an encoder of `num_layers` blocks over the source tokens
    and a decoder of `num_decoder_layers` (as many when left out) over the target tokens,
    which attends to the encoder's output too; `num_heads` heads of `d_kv` (not d_model /
    num_heads in every size), unscaled scores plus a learned bias per head for
    `relative_attention_num_buckets` buckets of distances out to
    `relative_attention_max_distance`, RMS norms, an MLP of width `d_ff` (`feed_forward_proj`:
    `relu` for the original T5, `gated-gelu` for T5 v1.1 and Flan-T5), one token table for
    both stacks (`shared`) and a head tied to it unless `tie_word_embeddings` is false. Its
    defaults are transformers' (t5-small's sizes, the original T5's MLP and tying).

    transformers derives `dense_act_fn` and `is_gated_act` from `feed_forward_proj` (gelu_new
    for `gated-gelu`), and `save_pretrained` writes them too; `activation` and `gated` are
    what it derives."""

    model_type: Literal["t5"]
    architectures: list[str] | None = None
    vocab_size: PositiveInt = 32128
    d_model: PositiveInt = 512
    d_kv: PositiveInt = 64
    d_ff: PositiveInt = 2048
    num_layers: PositiveInt = 6
    num_decoder_layers: PositiveInt | None = None
    num_heads: PositiveInt = 8
    relative_attention_num_buckets: PositiveInt = 32
    relative_attention_max_distance: PositiveInt = 128
    layer_norm_epsilon: PositiveFloat = 1e-6
    feed_forward_proj: FeedForward = "relu"
    dense_act_fn: str | None = None
    is_gated_act: bool | None = None
    tie_word_embeddings: bool = True
    is_encoder_decoder: bool = True

    @property
    def decoder_layers(self) -> int:
        return self.num_decoder_layers if self.num_decoder_layers is not None else self.num_layers

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def activation(self) -> str:
        """The MLP's activation, as ACT2FN names it."""
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]


def _pair(side: int | list[int]) -> tuple[int, int]:
    if isinstance(side, int):
        return side, side
    height, width = side
    return height, width


def _rope_type(*given: dict[str, Any] | None) -> str:
    """ "default" for plain rotary embeddings; otherwise the scaling the first config field
    `given` that says one asks for."""
    for fields in given:
        if fields:
            return str(fields.get("rope_type", fields.get("type", "default")))
    return "default"


CONFIGS = (
    GPT2Config
    | LlamaConfig
    | MixtralConfig
    | Qwen3MoeConfig
    | Qwen2MoeConfig
    | GPTNeoXConfig
    | Gemma2Config
    | ViTConfig
    | T5Config
)
HFConfig = Annotated[CONFIGS, Field(discriminator="model_type")]
# A config.json as `parse_config` reads it (Mixtral's and the Qwen MoEs' are LlamaConfigs).
AnyConfig = GPT2Config | LlamaConfig | GPTNeoXConfig | Gemma2Config | ViTConfig | T5Config
MODEL_TYPES = (
    "gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "qwen2_moe", "gpt_neox", "gemma2", "vit", "t5",
)  # fmt: skip
_ADAPTER: TypeAdapter[CONFIGS] = TypeAdapter(HFConfig)


def read_config_json(folder: Path) -> object:
    """The folder's config.json as JSON, not yet validated (`parse_config` does); a
    CheckpointError (C004) when it cannot be read or is not JSON."""
    path = folder / CONFIG
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise file_problem(path, "C004", f"no {CONFIG}: a Hugging Face checkpoint folder holds one") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise file_problem(path, "C004", f"cannot read it: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise file_problem(path, "C004", f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    return data


def parse_config(data: object, path: Path) -> AnyConfig:
    """config.json's content (at `path`, for the messages), validated; a CheckpointError
    (C004) when it cannot be used."""
    if not isinstance(data, dict):
        raise file_problem(path, "C004", "not a JSON object")
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise file_problem(
            path,
            "C004",
            f"model_type {json.dumps(model_type)} is not one dslc maps"
            if model_type is not None
            else "no `model_type`",
            notes=[f"dslc imports and exports {', '.join(MODEL_TYPES)} checkpoints"],
        )
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        problems = [
            f"`{'.'.join(str(part) for part in err['loc'][1:])}`: {err['msg'].lower()}"
            + (f", got {json.dumps(err['input'])}" if err["type"] != "missing" else "")
            for err in exc.errors()
        ]
        count = f"{len(problems)} unusable value{'s' * (len(problems) != 1)}"
        raise file_problem(path, "C004", count, notes=problems) from None
