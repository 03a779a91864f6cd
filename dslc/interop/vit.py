"""ViT (`ViTForImageClassification`) checkpoints.

Layout: `vit.embeddings.cls_token` [1, 1, d], `vit.embeddings.position_embeddings` [1,
patches + 1, d] and the patch embedding `vit.embeddings.patch_embeddings.projection`, a
Conv2d whose kernel is [d, channels, patch, patch] (out, in, height, width) and whose stride
is its size; per layer `layernorm_before`, `attention.attention.{query,key,value}`,
`attention.output.dense`, `layernorm_after`, `intermediate.dense`, `output.dense`; then
`vit.layernorm` and the `classifier` (no pooler: ViTForImageClassification builds its ViT
without one). The projections are `nn.Linear`s, whose weights are [out, in]: the transposes
of the spec's kernels. The spec's `conv` reads images [batch, height, width, channels] with
a kernel [height, width, in, out]: the Conv2d's, its axes taken in the order (2, 3, 1, 0) on
the way in. Its output, [batch, rows, columns, d], read row by row by `flatten`, is the
sequence transformers makes of the Conv2d's [batch, d, rows, columns] (`flatten(2)
.transpose(1, 2)`): the same patches in the same order. The class token and the position
table lose their leading axes of size 1.

What the spec computes as transformers does: the class token before the patches and the
positions added after it (`class_token`, then `position_embed`, one row for each patch and
one for the class token), attention that looks both ways with biases on q, k, v and o, the
exact GELU (`hidden_act: "gelu"`; `gelu_new` and `gelu_pytorch_tanh` are `gelu()`), and the
classifier on the class token's vector after the final layernorm (`pool(mode=first)`). The
image is the size the config states: transformers interpolates the positions for another
only when asked to (`interpolate_pos_encoding`), which the spec does not express.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dslc.interop.gpt2 import APPROXIMATE, EXACT
from dslc.interop.gpt_neox import activation_fact
from dslc.interop.hf_config import AnyConfig, ViTConfig
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
    with_biases,
)
from dslc.ir import nodes as ir
from dslc.layers import args
from dslc.layers.attention import Attention
from dslc.layers.conv import Conv
from dslc.layers.dense import Linear, PositionEmbed
from dslc.layers.elementwise import Gelu
from dslc.layers.norm import LayerNorm
from dslc.layers.vision import ClassToken, Pool

PREFIX = "vit."
HEAD = "classifier."
ARCHITECTURE = "ViTForImageClassification"
STRUCTURE = Structure(
    "ViT",
    ("conv", "flatten", "class_token", "position_embed"),
    (OPEN, "layernorm", "attention", CLOSE, OPEN, "layernorm", "linear", "gelu", "linear", CLOSE),
    ("layernorm", "pool", "linear"),
)
# ViT checkpoints carry no buffers.
_NO_BUFFER = re.compile(r"(?!)")
# The spec's kernel [height, width, in, out] as the Conv2d's [out, in, height, width].
CONV_AXES = (3, 2, 0, 1)


class ViT(FamilyBase):
    name = "ViT"
    model_types: tuple[str, ...] = ("vit",)
    structure = STRUCTURE
    prefix = PREFIX
    buffer = _NO_BUFFER
    tied_by_default = False
    head_tensor = HEAD + "weight"

    def canonical(self, name: str) -> str:
        # The classifier sits beside `vit.`, its bias as well as its weight.
        return name if name.startswith((PREFIX, HEAD)) else PREFIX + name

    def ties(self, m: Matched) -> bool:
        return False  # a classifier has no embedding to be tied to

    def tied(self, m: Matched, program: ir.Program) -> bool:
        return False

    def head_and_table(self, m: Matched) -> tuple[str, str]:
        # Read only where the head is tied, which a ViT's never is: the classifier twice.
        head = layer_weight(self.head_layer(m), "kernel")
        return head, head

    def requirements(self, m: Matched) -> list[Requirement]:
        conv, _, _, positions = m.prefix
        ln_f, pool, head = m.suffix
        seq = positions.input.shape[-2]
        out = [
            Requirement(
                conv,
                bool(args(conv, Conv).bias),
                "its patch embedding (a Conv2d) has a bias",
                "write `bias=true` on the conv",
            ),
            Requirement(
                positions,
                args(positions, PositionEmbed).positions == seq,
                f"its position table holds one row for each patch and one for the class token ({seq} here)",
                f"write `position_embed({seq}, ...)`",
            ),
            Requirement(
                pool,
                args(pool, Pool).mode == "first",
                "its classifier reads the class token's vector",
                "write `pool(mode=first)`",
            ),
            Requirement(head, bool(args(head, Linear).bias), "its classifier has a bias", "write `bias=true`"),
        ]
        d = args(conv, Conv).out
        for ln_1, attn, ln_2, fc, _, proj in m.blocks:
            a = args(attn, Attention)
            out += [
                Requirement(attn, not a.causal, "its attention looks both ways", "write `causal=false`"),
                Requirement(attn, not a.rope, "it has no rotary embeddings", "leave `rope` false"),
                Requirement(
                    attn,
                    bool(a.bias),
                    "its attention adds biases to q, k, v and o",
                    "write `bias=true` on the attention",
                ),
                Requirement(
                    attn, a.kv_heads == a.heads, "every query head has its own key/value head", "leave out `kv_heads`"
                ),
                Requirement(attn, a.head_dim * a.heads == d, "its heads split the model width", "leave out `head_dim`"),
                Requirement(attn, a.segments is None, "each image attends to all of itself", "leave out `segments`"),
            ]
            out += with_biases((fc, proj), "MLP's projections") + with_biases((ln_1, ln_2), "layernorms")
        out += with_biases((ln_f,), "layernorms")
        return out

    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]:
        assert isinstance(config, ViTConfig)
        conv, _, cls, positions = m.prefix
        ln_f, _, head = m.suffix
        c = args(conv, Conv)
        (height, width), (patch, _) = config.image, config.patch
        image = conv.input.shape
        # The family spec's `side` is the height and the width: it holds a square image's, while
        # an image of another shape is an edit of the images input.
        side = "side" if height == width else None
        shape = f"make the images input [batch, {height}, {width}, channels]"
        out = [
            Fact(
                "image_size",
                height,
                image[1],
                "image height",
                conv,
                side,
                shape,
                stated=None if isinstance(config.image_size, int) else f"{config.image_size} (height {height})",
            ),
            Fact(
                "image_size",
                width,
                image[2],
                "image width",
                conv,
                side,
                shape,
                stated=None if isinstance(config.image_size, int) else f"{config.image_size} (width {width})",
            ),
            Fact(
                "num_channels",
                config.num_channels,
                image[3],
                "number of image channels",
                conv,
                "channels",
                "change the images input's last dimension",
            ),
            Fact(
                "num_channels",
                config.num_channels,
                c.in_,
                "conv's input channels",
                conv,
                "channels",
                "change the conv's `in`",
            ),
            # A square patch: one whose sides differ is refused (`unsupported`), the conv's window being square.
            Fact(
                "patch_size",
                patch,
                c.kernel,
                "patch size (the conv's kernel)",
                conv,
                "patch",
                f"write `kernel={patch}` on the conv",
            ),
            Fact(
                "patch_size",
                patch,
                c.stride,
                "patch step (the conv's stride)",
                conv,
                "patch",
                f"write `stride={patch}` on the conv: the patches do not overlap",
            ),
            Fact("hidden_size", config.hidden_size, c.out, "width", conv, "d", "change the conv's `out`"),
            Fact(
                "hidden_size",
                config.hidden_size,
                args(cls, ClassToken).dim,
                "class token's width",
                cls,
                "d",
                "change `dim`",
            ),
            Fact(
                "hidden_size",
                config.hidden_size,
                args(positions, PositionEmbed).dim,
                "position vectors' width",
                positions,
                "d",
                "change `dim`",
            ),
            Fact(
                "num_hidden_layers",
                config.num_hidden_layers,
                len(m.blocks),
                "number of layers",
                m.blocks[0][0],
                "layers",
                f"repeat the block {config.num_hidden_layers} times",
            ),
        ]
        for _, attn, _, fc, gelu, proj in m.blocks:
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
            ]
            if config.hidden_act in APPROXIMATE + EXACT:  # another is refused (`unsupported`)
                out.append(activation_fact(config.hidden_act, gelu))
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
            for ln in (*(b[0] for b in m.blocks), *(b[2] for b in m.blocks), ln_f)
        ]
        if config.labels == 0:  # no classifier at all: refused (`unsupported`), not a size to set
            return out
        out.append(
            Fact(
                "id2label" if config.id2label is not None else "num_labels",
                config.labels,
                args(head, Linear).out,
                "number of classes (the classifier's outputs)",
                head,
                "classes",
                "change the classifier's `out`",
                stated=f"{config.labels} labels" if config.id2label is not None else None,
            )
        )
        return out

    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]:
        assert isinstance(config, ViTConfig)
        out = []
        if config.architectures is not None and ARCHITECTURE not in config.architectures:
            out.append(
                (
                    f"architectures {config.architectures}: dslc maps {ARCHITECTURE}, a classifier on the class token",
                    "a ViTModel (with its pooler) or a ViT for masked image modelling has other weights",
                )
            )
        if config.labels == 0:
            out.append(
                (
                    "no labels: transformers' ViTForImageClassification without any has no classifier, dslc's ends "
                    "in one",
                    "id2label is empty" if config.id2label is not None else "num_labels is 0",
                )
            )
        if config.hidden_act not in APPROXIMATE + EXACT:
            out.append(
                (
                    f"hidden_act {config.hidden_act!r} is not one dslc computes",
                    "dslc's gelu is gelu (erf) or gelu_new (tanh)",
                )
            )
        if not config.qkv_bias:
            out.append(
                (
                    "qkv_bias is false: dslc's attention adds a bias to o only where it adds them to q, k and v",
                    "ViT's output projection always has one",
                )
            )
        (patch_h, patch_w), (height, width) = config.patch, config.image
        if patch_h != patch_w:
            out.append((f"patch_size {config.patch_size}: dslc's conv windows are square", ""))
        elif height % patch_h or width % patch_w:
            out.append(
                (
                    f"image_size {config.image_size} is not a multiple of patch_size {config.patch_size}: "
                    "transformers' patches leave out the last rows and columns, dslc's conv pads the image",
                    "",
                )
            )
        return out

    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]:
        conv, _, cls, positions = m.prefix
        ln_f, _, head = m.suffix
        emb = PREFIX + "embeddings."
        out = [
            TensorMap(emb + "cls_token", (layer_weight(cls, "token"),), ones=2),
            TensorMap(emb + "position_embeddings", (layer_weight(positions, "table"),), ones=1),
            TensorMap(emb + "patch_embeddings.projection.weight", (layer_weight(conv, "kernel"),), axes=CONV_AXES),
            TensorMap(emb + "patch_embeddings.projection.bias", (layer_weight(conv, "bias"),)),
        ]

        def linear(name: str, layer: ir.Layer, kernel: str = "kernel", bias: str = "bias") -> list[TensorMap]:
            return [
                TensorMap(name + ".weight", (layer_weight(layer, kernel),), transposed=True, kernel=True),
                TensorMap(name + ".bias", (layer_weight(layer, bias),)),
            ]

        def norm(name: str, layer: ir.Layer) -> list[TensorMap]:
            return [
                TensorMap(name + ".weight", (layer_weight(layer, "scale"),)),
                TensorMap(name + ".bias", (layer_weight(layer, "bias"),)),
            ]

        for i, (ln_1, attn, ln_2, fc, _, proj) in enumerate(m.blocks):
            at = f"{PREFIX}encoder.layer.{i}."
            out += norm(at + "layernorm_before", ln_1)
            for w, name in (("q", "query"), ("k", "key"), ("v", "value")):
                out += linear(f"{at}attention.attention.{name}", attn, w, f"{w}_bias")
            out += linear(at + "attention.output.dense", attn, "o", "o_bias")
            out += norm(at + "layernorm_after", ln_2)
            out += linear(at + "intermediate.dense", fc)
            out += linear(at + "output.dense", proj)
        out += norm(PREFIX + "layernorm", ln_f)
        out += linear(HEAD.removesuffix("."), head)
        return out

    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]:
        conv, *_ = m.prefix
        ln_1, attn, _, fc, gelu, _ = m.blocks[0]
        c = args(conv, Conv)
        _, height, width, channels = conv.input.shape
        classes = args(m.suffix[-1], Linear).out
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "vit",
            "hidden_size": c.out,
            "num_hidden_layers": len(m.blocks),
            "num_attention_heads": args(attn, Attention).heads,
            "intermediate_size": args(fc, Linear).out,
            "hidden_act": "gelu_new" if args(gelu, Gelu).approximate else "gelu",
            "layer_norm_eps": args(ln_1, LayerNorm).eps,
            "image_size": height if height == width else [height, width],
            "patch_size": c.kernel,
            "num_channels": channels,
            "qkv_bias": True,
            # transformers' names for labels it was not told: the spec knows only how many.
            "id2label": {str(i): f"LABEL_{i}" for i in range(classes)},
            "label2id": {f"LABEL_{i}": i for i in range(classes)},
            "torch_dtype": dtype,
        }

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        """As the other families keep it, and the original's names of its labels (the
        dataset's, which the spec does not know) where it has as many as the spec's classes;
        its image and patch sizes as it wrote them ([16, 16] or 16) where they are the spec's."""
        out = super().keep(written, original)
        names, ids = original.get("id2label"), original.get("label2id")
        count = len(written["id2label"])  # type: ignore[arg-type]
        if isinstance(names, dict) and len(names) == count:
            out["id2label"] = names
            if isinstance(ids, dict) and len(ids) == count:
                out["label2id"] = ids
            else:
                out.pop("label2id", None)
        if "num_labels" in out:  # another name for the classifier's width, where a config states it
            out["num_labels"] = count
        for key in ("image_size", "patch_size"):
            given = original.get(key)
            if isinstance(given, list) and given == [written[key]] * 2:
                out[key] = given
        return out
