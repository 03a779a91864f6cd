"""T5 (`T5ForConditionalGeneration`: T5 v1.1, Flan-T5) checkpoints.

Layout: `shared` [vocab, d], the one token table of both stacks (transformers ties
`encoder.embed_tokens` and `decoder.embed_tokens` to it, and `save_pretrained` stores it
once: a checkpoint that stores them too must hold the same tensor there, and one that stores
only them is read from them); the encoder's blocks, `encoder.block.N.layer.0` (`layer_norm`,
`SelfAttention.{q,k,v,o}`) and `layer.1` (`layer_norm`, `DenseReluDense.{wi_0,wi_1,wo}`),
block 0's self-attention also holding the stack's relative position bias
(`relative_attention_bias` [buckets, heads], which every block of the stack adds); then
`encoder.final_layer_norm`; the decoder's blocks likewise with the cross-attention between
(`layer.1`: `layer_norm`, `EncDecAttention.{q,k,v,o}`; the MLP is `layer.2`), then
`decoder.final_layer_norm`; and the head `lm_head` [vocab, d]. The projections are
`nn.Linear`s without biases, whose weights are [out, in]: the transposes of the spec's
kernels. The bias tables are the spec's `relative_position_bias` tables as they are. Older
checkpoints carry a bias table in the first cross-attention that transformers never reads
(`_keys_to_ignore_on_load_unexpected`): it is ignored here too.

The spec (specs/t5.par) holds the encoder as a stream its cross-attention reads (`memory=`)
and each stack's bias as a stream of its own (`position_bias=`), so a T5 is matched in
parts: the body of `forward` as the decoder, then the streams its layers name. What it
computes as transformers does: attention scores q·k not scaled (`scale=1.0`) plus the bias
(T5's buckets: the encoder's both ways, the decoder's of earlier keys only), the decoder's
self-attention causal and its cross-attention over every source token with no bias, RMS
norms without a mean or a bias (`rmsnorm`; transformers' T5LayerNorm, in f32), the gated
MLP gelu_new(x wi_0) * (x wi_1) then wo (`swiglu(d, ffn, activation=gelu)`, the tanh GELU,
its `gate` wi_0 and its `up` wi_1), and the logits the head's product with the decoder's
last norm. A tied head is refused: transformers scales the decoder's output by
d_model ** -0.5 before a tied head, which the spec does not compute (T5 v1.1 and Flan-T5
untie it; the original T5 ties it, and its MLP is not gated either).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import error
from dslc.interop.errors import CheckpointError
from dslc.interop.gpt2 import APPROXIMATE
from dslc.interop.hf_config import AnyConfig, T5Config
from dslc.interop.mapping import (
    CLOSE,
    OPEN,
    Fact,
    FamilyBase,
    Matched,
    Requirement,
    Structure,
    TensorMap,
    forward_end,
    layer_weight,
    match_nodes,
)
from dslc.ir import nodes as ir
from dslc.layers import args
from dslc.layers.attention import Attention, RelativePositionBias
from dslc.layers.dense import Embed, Linear, SwiGLU
from dslc.layers.norm import RmsNorm

ARCHITECTURES = ("T5ForConditionalGeneration", "T5WithLMHeadModel")  # the second, older transformers' name
_ENCODER_BLOCK = (OPEN, "rmsnorm", "attention", CLOSE, OPEN, "rmsnorm", "swiglu", "linear", CLOSE)
ENCODER = Structure(
    "T5", ("embed",), _ENCODER_BLOCK, ("rmsnorm",), whole="a T5's encoder (the stream its cross-attention reads)"
)
STRUCTURE = Structure(
    "T5",
    ("embed",),
    # Self-attention, cross-attention, the MLP.
    (OPEN, "rmsnorm", "attention", CLOSE, OPEN, "rmsnorm", "attention", CLOSE, *_ENCODER_BLOCK[4:]),
    ("rmsnorm", "linear"),
    whole="a T5's decoder (the body of `forward`, after the streams of its encoder and of each stack's position bias)",
)
# The bias table older checkpoints carry in the first cross-attention, which transformers ignores.
_UNREAD = re.compile(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")
SHARED = "shared.weight"
# Where each transformers activation of a gated MLP is the spec's swiglu `activation`.
_GATES = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "silu": "silu", "swish": "silu"}
assert set(APPROXIMATE) <= set(_GATES)


@dataclass(frozen=True, slots=True)
class T5Matched(Matched):
    """A T5: the decoder as `Matched` (the body of `forward`), the encoder's stream (`encoder`,
    matched on its own, named `encoded`), and each stack's `relative_position_bias` layer
    with the name of the stream that holds it."""

    encoder: Matched
    encoded: str
    encoder_bias: ir.Layer
    encoder_bias_name: str
    decoder_bias: ir.Layer
    decoder_bias_name: str


def _t5(m: Matched) -> T5Matched:
    assert isinstance(m, T5Matched), "T5 maps what T5.match matched"
    return m


def _refused(layer: ir.Node, message: str, fix: str | None = None) -> CheckpointError:
    return CheckpointError([error("C002", f"the spec is not built like a T5: {message}", layer.span, help=fix)])


def _stream(streams: dict[str, ir.Stream], layer: ir.Layer, name: str | None, role: str, argument: str) -> ir.Stream:
    """The stream `layer` names as `argument` (`name`), which holds its `role`; C002 when it
    names none, or a declared input, whose weights could not be the checkpoint's."""
    if name is None:
        raise _refused(layer, f"`{layer.path}` reads {role} (`{argument}=`, a stream)", f"write `{argument}=STREAM`")
    if name not in streams:
        raise _refused(
            layer,
            f"`{layer.path}` reads {role} from the input `{name}`, not from a stream of the spec",
            f"compute {role} in a `stream` and name it in `{argument}=`",
        )
    return streams[name]


def _bias_layer(stream: ir.Stream, reader: ir.Layer) -> ir.Layer:
    """The one `relative_position_bias` layer a bias stream holds (C002 otherwise)."""
    body = [n for n in stream.body if not isinstance(n, ir.Layout)]
    if len(body) == 1 and isinstance(body[0], ir.Layer) and body[0].kind == "relative_position_bias":
        return body[0]
    raise _refused(
        stream,
        f"the stream `{stream.path}`, which `{reader.path}` adds to its scores, should hold one "
        "`relative_position_bias` and nothing else",
    )


# T5's token ids: the decoder starts from the padding id, and every T5 v1.1 and Flan-T5 config
# says these. Without `decoder_start_token_id` transformers cannot shift the labels right
# (training) or start generating; an exported T5 states them unless its imported config
# said others.
TOKEN_IDS = {"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}


class T5(FamilyBase):
    name = "T5"
    model_types: tuple[str, ...] = ("t5",)
    structure = STRUCTURE
    prefix = ""
    buffer = _UNREAD
    tied_by_default = False
    attention_arguments = frozenset({"memory", "position_bias", "scale"})

    def match(self, program: ir.Program) -> Matched:
        """The body of `forward` as the decoder, then the streams its layers read: the encoder
        its cross-attention's `memory`, each stack's bias its self-attention's `position_bias`
        (block 0's: the others' are requirements). A stream that is none of these is refused,
        as a layer out of place would be."""
        nodes = ir.unrolled(program.nodes)
        streams = {n.path: n for n in nodes if isinstance(n, ir.Stream)}
        body = [n for n in nodes if not isinstance(n, ir.Stream)]
        decoder = match_nodes(self.structure, body, forward_end(program))
        self_attn, cross = decoder.blocks[0][1], decoder.blocks[0][3]
        source = _stream(streams, cross, args(cross, Attention).memory, "the encoder's output", "memory")
        encoder = match_nodes(ENCODER, source.body, source.span, f"the end of the stream `{source.path}`")
        encoder_attn = encoder.blocks[0][1]
        biases = []
        for attn, stack in ((encoder_attn, "encoder"), (self_attn, "decoder")):
            role = f"the {stack}'s relative position bias"
            stream = _stream(streams, attn, args(attn, Attention).position_bias, role, "position_bias")
            biases.append((_bias_layer(stream, attn), stream.path))
        (encoder_bias, encoder_bias_name), (decoder_bias, decoder_bias_name) = biases
        if encoder_bias_name == decoder_bias_name:
            raise _refused(
                self_attn,
                f"its encoder and its decoder add a position bias each, not both `{encoder_bias_name}`",
                "give the decoder a stream of its own: `relative_position_bias(..., bidirectional=false)`",
            )
        for name, stream in streams.items():
            if name not in (source.path, encoder_bias_name, decoder_bias_name):
                raise _refused(
                    stream,
                    f"the stream `{name}` is none of a T5's (its encoder, and each stack's position bias)",
                    "leave it out",
                )
        return T5Matched(
            decoder.prefix,
            decoder.blocks,
            decoder.suffix,
            encoder,
            source.path,
            encoder_bias,
            encoder_bias_name,
            decoder_bias,
            decoder_bias_name,
        )

    def ties(self, m: Matched) -> bool:
        return False  # a tied T5 is refused (`unsupported`)

    def tied(self, m: Matched, program: ir.Program) -> bool:
        return False

    def head_and_table(self, m: Matched) -> tuple[str, str]:
        return layer_weight(self.head_layer(m), "kernel"), layer_weight(_t5(m).encoder.prefix[0], "table")

    def copies(self, name: str) -> tuple[str, ...]:
        return ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") if name == SHARED else ()

    def requirements(self, m: Matched) -> list[Requirement]:
        t = _t5(m)
        enc = t.encoder
        (encoder_embed,), (decoder_embed,), head = enc.prefix, t.prefix, self.head_layer(t)
        table = layer_weight(encoder_embed, "table")
        tie = decoder_embed.weight("table").tie
        out = [
            self.head_has_no_bias(t),
            Requirement(
                head,
                head.weight("kernel").tie is None,
                "its head is a weight of its own (T5 v1.1 and Flan-T5 untie it)",
                "drop the head's `tie`",
            ),
            Requirement(
                decoder_embed,
                tie is not None and tie.name == table and not tie.transposed,
                f"its decoder embeds its tokens with the encoder's table (`{table}`)",
                f"write `tie table = {table}` on the decoder's embedding",
            ),
        ]
        out += [
            Requirement(e, not args(e, Embed).scale, "its embeddings are not scaled", "leave out `scale`")
            for e in (encoder_embed, decoder_embed)
        ]
        for bias, both_ways, stack in ((t.encoder_bias, True, "encoder"), (t.decoder_bias, False, "decoder")):
            out.append(
                Requirement(
                    bias,
                    args(bias, RelativePositionBias).bidirectional is both_ways,
                    f"its {stack}'s position buckets "
                    + ("tell keys before a query from keys after it" if both_ways else "are of earlier keys only"),
                    f"write `bidirectional={'true' if both_ways else 'false'}`",
                )
            )
        norms = [*(b[i] for b in enc.blocks for i in (0, 2)), enc.suffix[0]]
        norms += [*(b[i] for b in t.blocks for i in (0, 2, 4)), t.suffix[0]]
        out += [
            Requirement(n, not args(n, RmsNorm).offset, "its norms scale by their weight itself", "leave out `offset`")
            for n in norms
        ]
        for block in enc.blocks:
            out += _attention(block[1], "its encoder's attention", False, t.encoder_bias_name, None)
            out.append(_no_bias(block[4]))
        for block in t.blocks:
            out += _attention(block[1], "its decoder's self-attention", True, t.decoder_bias_name, None)
            out += _attention(block[3], "its cross-attention", False, None, t.encoded)
            out.append(_no_bias(block[6]))
        return out

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, T5Config)
        t = _t5(m)
        enc = t.encoder
        (embed,) = enc.prefix
        # One constant holds both stacks' depth in specs/t5.par: a checkpoint whose decoder is
        # deeper or shallower than its encoder is an edit of the spec, not a `--set`.
        same_depth = config.decoder_layers == config.num_layers
        decoder_key = "num_decoder_layers" if config.num_decoder_layers is not None else "num_layers"
        out = [
            *self.vocab_facts(config.vocab_size, t),
            Fact(
                "vocab_size",
                config.vocab_size,
                args(embed, Embed).vocab,
                "vocabulary size",
                embed,
                "vocab",
                "change `vocab`",
            ),
            Fact("d_model", config.d_model, args(embed, Embed).dim, "width", embed, "d", "change `dim`"),
            Fact(
                "num_layers",
                config.num_layers,
                len(enc.blocks),
                "number of encoder blocks",
                enc.blocks[0][0],
                "layers",
                f"repeat the encoder's block {config.num_layers} times",
            ),
            Fact(
                decoder_key,
                config.decoder_layers,
                len(t.blocks),
                "number of decoder blocks",
                t.blocks[0][0],
                "layers" if same_depth else None,
                f"repeat the decoder's block {config.decoder_layers} times",
            ),
        ]
        for bias in (t.encoder_bias, t.decoder_bias):
            b = args(bias, RelativePositionBias)
            out += [
                Fact(
                    "num_heads",
                    config.num_heads,
                    b.heads,
                    "number of position bias heads",
                    bias,
                    "heads",
                    "change `heads`",
                ),
                Fact(
                    "relative_attention_num_buckets",
                    config.relative_attention_num_buckets,
                    b.buckets,
                    "number of position buckets",
                    bias,
                    "buckets",
                    f"write `buckets={config.relative_attention_num_buckets}`",
                ),
                Fact(
                    "relative_attention_max_distance",
                    config.relative_attention_max_distance,
                    b.max_distance,
                    "farthest bucketed distance",
                    bias,
                    "max_distance",
                    f"write `max_distance={config.relative_attention_max_distance}`",
                ),
            ]
        attentions = [b[1] for b in enc.blocks] + [b[i] for b in t.blocks for i in (1, 3)]
        for attn in attentions:
            a = args(attn, Attention)
            out += [
                Fact(
                    "num_heads", config.num_heads, a.heads, "number of attention heads", attn, "heads", "change `heads`"
                ),
                Fact(
                    "d_kv",
                    config.d_kv,
                    a.head_dim,
                    "head width",
                    attn,
                    "head_dim",
                    f"write `head_dim={config.d_kv}` on the attention",
                ),
            ]
        gate = _GATES.get(config.activation) if config.gated else None
        for gate_up, down in [(b[3], b[4]) for b in enc.blocks] + [(b[5], b[6]) for b in t.blocks]:
            out += [
                Fact("d_ff", config.d_ff, args(gate_up, SwiGLU).hidden, "MLP width", gate_up, "ffn", "change `hidden`"),
                Fact("d_ff", config.d_ff, args(down, Linear).in_, "MLP width", down, "ffn", "change `in`"),
            ]
            if gate is not None:  # another is refused (`unsupported`)
                out.append(
                    Fact(
                        "feed_forward_proj",
                        gate,
                        args(gate_up, SwiGLU).activation,
                        "MLP's gate activation",
                        gate_up,
                        None,
                        f"write `activation={gate}` on the swiglu",
                        stated=f'"{config.feed_forward_proj}" ({gate})',
                    )
                )
        norms = [*(b[i] for b in enc.blocks for i in (0, 2)), enc.suffix[0]]
        norms += [*(b[i] for b in t.blocks for i in (0, 2, 4)), t.suffix[0]]
        out += [
            Fact(
                "layer_norm_epsilon",
                config.layer_norm_epsilon,
                args(n, RmsNorm).eps,
                "rmsnorm eps",
                n,
                "eps",
                "change `eps`",
            )
            for n in norms
        ]
        return out

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, T5Config)
        out = []
        computes = (
            "dslc's T5 computes T5 v1.1's and Flan-T5's MLP, gelu_new(x wi_0) * (x wi_1), "
            "`swiglu(d, ffn, activation=gelu)`"
        )
        if config.architectures is not None and not set(ARCHITECTURES) & set(config.architectures):
            out.append(
                (
                    f"architectures {config.architectures}: dslc maps T5ForConditionalGeneration, an encoder-decoder "
                    "with its head",
                    "a T5EncoderModel or a T5 for classification or questions has other weights",
                )
            )
        if not config.is_encoder_decoder:
            out.append(("is_encoder_decoder is false: dslc's T5 is an encoder and a decoder", ""))
        if not config.gated:
            out.append(
                (
                    f"feed_forward_proj {config.feed_forward_proj!r}: the original T5's MLP, not gated, which the "
                    "spec's gated one does not compute",
                    computes + " (or with silu: gated-silu)",
                )
            )
        elif config.activation not in _GATES:
            out.append(
                (
                    f"feed_forward_proj {config.feed_forward_proj!r}: a gate dslc does not compute",
                    computes + " (gated-gelu), or with silu (gated-silu)",
                )
            )
        for key, value, derived in (
            ("dense_act_fn", config.dense_act_fn, config.activation),
            ("is_gated_act", config.is_gated_act, config.gated),
        ):
            if value is not None and value != derived:
                out.append(
                    (
                        f"{key} {value!r} contradicts feed_forward_proj {config.feed_forward_proj!r}, which makes it "
                        f"{derived!r}",
                        "transformers derives it from feed_forward_proj; a config that says otherwise is not one "
                        "dslc can tell the meaning of",
                    )
                )
        if config.tie_word_embeddings:
            out.append(
                (
                    "tie_word_embeddings is true: transformers then scales the decoder's output by d_model ** -0.5 "
                    "before the head, which dslc's T5 does not compute",
                    "T5 v1.1 and Flan-T5 have a head of their own (tie_word_embeddings false); the original T5 ties it",
                )
            )
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        t = _t5(m)
        enc = t.encoder
        out = [TensorMap(SHARED, (layer_weight(enc.prefix[0], "table"),))]

        def linear(name: str, layer: ir.Layer, weight: str = "kernel") -> TensorMap:
            return TensorMap(name + ".weight", (layer_weight(layer, weight),), transposed=True, kernel=True)

        def attention(at: str, attn: ir.Layer) -> list[TensorMap]:
            return [linear(f"{at}.{w}", attn, w) for w in "qkvo"]

        def mlp(at: str, gate_up: ir.Layer, down: ir.Layer) -> list[TensorMap]:
            return [
                linear(at + ".wi_0", gate_up, "gate"),
                linear(at + ".wi_1", gate_up, "up"),
                linear(at + ".wo", down),
            ]

        def norm(name: str, layer: ir.Layer) -> TensorMap:
            return TensorMap(name + ".weight", (layer_weight(layer, "scale"),))

        for i, (n1, attn, n2, gate_up, down) in enumerate(enc.blocks):
            at = f"encoder.block.{i}.layer."
            out += [norm(at + "0.layer_norm", n1), *attention(at + "0.SelfAttention", attn)]
            if i == 0:
                bias = layer_weight(t.encoder_bias, "table")
                out.append(TensorMap(at + "0.SelfAttention.relative_attention_bias.weight", (bias,)))
            out += [norm(at + "1.layer_norm", n2), *mlp(at + "1.DenseReluDense", gate_up, down)]
        out.append(norm("encoder.final_layer_norm", enc.suffix[0]))
        for i, (n1, attn, n2, cross, n3, gate_up, down) in enumerate(t.blocks):
            at = f"decoder.block.{i}.layer."
            out += [norm(at + "0.layer_norm", n1), *attention(at + "0.SelfAttention", attn)]
            if i == 0:
                bias = layer_weight(t.decoder_bias, "table")
                out.append(TensorMap(at + "0.SelfAttention.relative_attention_bias.weight", (bias,)))
            out += [norm(at + "1.layer_norm", n2), *attention(at + "1.EncDecAttention", cross)]
            out += [norm(at + "2.layer_norm", n3), *mlp(at + "2.DenseReluDense", gate_up, down)]
        out += [norm("decoder.final_layer_norm", t.suffix[0]), self.head(t)]
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        t = _t5(m)
        enc = t.encoder
        e, a = args(enc.prefix[0], Embed), args(enc.blocks[0][1], Attention)
        b = args(t.encoder_bias, RelativePositionBias)
        gate = args(enc.blocks[0][3], SwiGLU).activation
        return {
            "architectures": [ARCHITECTURES[0]],
            "model_type": "t5",
            "vocab_size": e.vocab,
            "d_model": e.dim,
            "d_kv": a.head_dim,
            "d_ff": args(enc.blocks[0][3], SwiGLU).hidden,
            "num_layers": len(enc.blocks),
            "num_decoder_layers": len(t.blocks),
            "num_heads": a.heads,
            "relative_attention_num_buckets": b.buckets,
            "relative_attention_max_distance": b.max_distance,
            "layer_norm_epsilon": args(enc.suffix[0], RmsNorm).eps,
            "feed_forward_proj": f"gated-{gate}",
            "dense_act_fn": "gelu_new" if gate == "gelu" else gate,
            "is_gated_act": True,
            "is_encoder_decoder": True,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            **TOKEN_IDS,
        }

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        # The token ids are the imported config's own where it says them (the spec does not).
        out = super().keep(written, original)
        return out | {key: original[key] for key in TOKEN_IDS if key in original}


def _attention(attn: ir.Layer, what: str, causal: bool, bias: str | None, memory: str | None) -> list[Requirement]:
    """What T5 asks of one attention layer (`what` names it): unscaled scores, the stack's
    bias stream (`bias`) or none, the encoder's stream as its memory (`memory`) or none,
    causal or not, and nothing the families' attention may add besides."""
    a = args(attn, Attention)
    return [
        Requirement(
            attn,
            a.causal is causal,
            f"{what} {'is causal' if causal else 'looks both ways'}",
            f"write `causal={'true' if causal else 'false'}`",
        ),
        Requirement(attn, a.scale == 1.0, f"{what} does not scale its scores", "write `scale=1.0`"),
        Requirement(
            attn,
            a.position_bias == bias,
            f"{what} adds the stream `{bias}` to its scores" if bias else f"{what} adds no position bias",
            f"write `position_bias={bias}`" if bias else "leave out `position_bias`",
        ),
        Requirement(
            attn,
            a.memory == memory,
            f"{what} reads the encoder's output `{memory}`" if memory else f"{what} reads its own input",
            f"write `memory={memory}`" if memory else "leave out `memory`",
        ),
        Requirement(attn, not a.rope, f"{what} has no rotary embeddings", "leave `rope` false"),
        Requirement(attn, not (a.bias or a.qkv_bias), f"{what} has no biases", "leave out `bias` and `qkv_bias`"),
        Requirement(attn, a.kv_heads == a.heads, "every query head has its own key/value head", "leave out `kv_heads`"),
        Requirement(attn, a.segments is None, f"{what} sees every token of its sequence", "leave out `segments`"),
    ]


def _no_bias(down: ir.Layer) -> Requirement:
    return Requirement(down, not args(down, Linear).bias, "its MLP has no biases", "write `bias=false`")
