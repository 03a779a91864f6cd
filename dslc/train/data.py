"""Which data set can feed a spec, decided from its declared inputs and loss.

`dslc train` needs no downloads: byte-level language models read Python's own standard
library (`corpus.py`), image classifiers read the handwritten digits shipped with dslc
(`digits.py`); `--data PATH` gives a language model the user's own tokens or text
(`tokens.py`), and an image classifier the user's own images and labels (`images.py`). A
spec whose inputs fit neither is refused with a message that says what each data set needs.
Nothing here imports jax: the decision is made on the checked IR.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dslc.ir import nodes as ir
from dslc.layers import args
from dslc.layers.attention import Attention
from dslc.layers.inputs import integer_bounds, loss_targets, packing
from dslc.train.corpus import stdlib_corpus
from dslc.train.dataset import DataError, Dataset
from dslc.train.digits import CLASSES, NATIVE_SIDE, DigitImages, input_side, load_digits
from dslc.train.images import ImageBatches, ImageShape, looks_like_images, open_images
from dslc.train.tokens import HELD_OUT, NextTokens, TokenData, in_memory, open_data


def dataset_for(program: ir.Program, data: Path | None = None, document_end: int | None = None) -> Dataset:
    """The data set that fits the spec's inputs: `data` (a path: tokens or text for language
    models, in a token file the id `document_end` ending a document; images and labels for
    image classifiers) or the embedded one; DataError says why none does."""
    stream = program.input(program.stream)
    loss = program.loss
    if loss is None:
        raise DataError(
            f"spec `{program.name}` has no loss layer (cross_entropy or mse) at the end of `forward`: nothing to train"
        )
    target = program.input(loss_targets(loss))
    packed = packing(program)
    segments, counted = packed.segments, packed.mask
    others = [i for i in program.inputs if i.name not in (stream.name, target.name, segments, counted)]
    if not others and _is_language_model(program, stream, target, loss):
        image_set = looks_like_images(data) if data is not None else None
        if image_set is not None:
            raise DataError(
                f"--data {data}: {image_set}, but spec `{program.name}` is a language model, which reads token "
                "files or text"
            )
        vocab = _token_count(program, stream, target, embedded=data is None)
        found = _stdlib_tokens() if data is None else open_data(data, vocab, document_end)
        ids = program.input(segments) if segments else None
        mask = program.input(counted) if counted else None
        held_out = NextTokens(
            found.held_out, vocab, stream, target, found.description + " (held out)", "", segments=ids, counted=mask
        )
        return NextTokens(found.train, vocab, stream, target, found.description, found.fingerprint, held_out, ids, mask)
    if not others and data is not None and _takes_images(stream, target, loss):
        shape = _image_shape(program, stream)
        classes = integer_bounds(program)[target.name] if loss.kind == "cross_entropy" else target.type.shape[1]
        return ImageBatches(open_images(data, shape, classes, program.name), shape, stream, target, classes)
    if data is not None:
        raise DataError(
            f"--data feeds language models (integer tokens read by an `embed`, targets of the same shape for "
            f"`cross_entropy`) and image classifiers (float images [batch, height, width, channels] or "
            f"[batch, side*side], integer labels [batch] or one-hot rows for `mse`), which spec `{program.name}` "
            "is neither"
        )
    if not others and _is_image_classifier(stream, target, loss):
        return DigitImages(load_digits(), stream, target)
    raise DataError(_refusal(program))


def data_notes(dataset: Dataset) -> tuple[str, ...]:
    """What the log says of the data after naming them: an image folder's labels by
    sub-folder, and the files it skipped."""
    return dataset.notes if isinstance(dataset, ImageBatches) else ()


def _stdlib_tokens() -> TokenData:
    text = stdlib_corpus()
    train, held_out = in_memory(text).split(HELD_OUT)
    description = (
        f"Python standard-library sources, byte-level ({len(text) / 1e6:.1f} MB, the last {HELD_OUT:.0%} held out)"
    )
    return TokenData(train, held_out, description, hashlib.sha256(text).hexdigest()[:16])


def data_warnings(program: ir.Program) -> list[str]:
    """What a person should know before training the spec on the data `dataset_for` gives it.

    Every language-model data set `dslc train` reads is next-token prediction: a target is
    the token after its position. Attention that also looks forward (`causal=false`) then
    reads the very token it is asked to predict, and the loss falls towards zero with nothing
    learnt that would generate text."""
    stream = program.input(program.stream)
    loss = program.loss
    if loss is None or loss.kind != "cross_entropy":
        return []
    target = program.input(loss_targets(loss))
    if not _is_language_model(program, stream, target, loss):
        return []
    layers = ir.all_layers(program)
    both_ways = [layer.path for layer in layers if layer.kind == "attention" and not args(layer, Attention).causal]
    if not both_ways:
        return []
    more = f" (and {len(both_ways) - 1} more)" if len(both_ways) > 1 else ""
    return [
        f"warning: `{both_ways[0]}`{more} attends both ways (causal=false), but every target is the next token: "
        "each position can read the token it is asked to predict, so the loss will fall without the model "
        "learning to predict; use causal=true for next-token training"
    ]


def _embedding(program: ir.Program) -> ir.Layer | None:
    """The layer that reads the integer token stream, if it is an embedding."""
    layers = ir.all_layers(program)
    return layers[0] if layers and layers[0].kind == "embed" else None


def _is_language_model(program: ir.Program, stream: ir.Input, target: ir.Input, loss: ir.Layer) -> bool:
    s, t = stream.type, target.type
    return (
        loss.kind == "cross_entropy"
        and s.dtype in ir.INT_DTYPES
        and t.dtype in ir.INT_DTYPES
        and s.rank == 2
        and t.shape == s.shape
        and _embedding(program) is not None
    )


def _token_count(program: ir.Program, stream: ir.Input, target: ir.Input, embedded: bool) -> int:
    """Token ids are both inputs and targets: each must index the embedding table and be a
    class the loss counts (below a padded vocabulary's logits), as `Program` checks a batch."""
    bounds = integer_bounds(program)
    vocab = min(bounds[stream.name], bounds[target.name])
    if embedded and vocab < 128:
        raise DataError(
            f"spec `{program.name}` is a language model over {vocab} token ids; the embedded corpus (Python's "
            "standard-library sources, byte-level) needs at least 128 (ASCII) and keeps every byte with 256: "
            "raise the embedding's vocabulary and the head's outputs (e.g. `--set vocab=256` where the spec "
            "names that constant `vocab`)"
        )
    return vocab


def _takes_images(stream: ir.Input, target: ir.Input, loss: ir.Layer) -> bool:
    """Whether the spec classifies images, of any size and class count: float images
    [batch, height, width, channels] or flattened [batch, width], with integer labels [batch]
    for `cross_entropy` or one-hot rows [batch, classes] for `mse`."""
    s, t = stream.type, target.type
    if s.dtype in ir.INT_DTYPES or s.rank not in (2, 4):
        return False
    if loss.kind == "cross_entropy":
        return t.dtype in ir.INT_DTYPES and t.shape == s.shape[:1]
    return t.dtype not in ir.INT_DTYPES and t.rank == 2 and t.shape[0] == s.shape[0]


def _image_shape(program: ir.Program, stream: ir.Input) -> ImageShape:
    s = stream.type
    if s.rank == 4:
        return ImageShape(s.shape[1], s.shape[2], s.shape[3])
    side = input_side(s)
    if side is None:
        raise DataError(
            f"input `{stream.name}` of spec `{program.name}` is {s.describe()}: a flat input takes one-channel "
            f"square images side*side pixels wide (e.g. 784 for 28x28), not {s.shape[1]}; declare it "
            "[batch, height, width, channels] for images of another shape"
        )
    return ImageShape(side, side, 1, flat=True)


def _is_image_classifier(stream: ir.Input, target: ir.Input, loss: ir.Layer) -> bool:
    s, t = stream.type, target.type
    if s.dtype in ir.INT_DTYPES or s.rank not in (2, 4):
        return False
    if loss.kind == "cross_entropy":
        labels_fit = t.shape == s.shape[:1] and loss.input.shape[-1] >= CLASSES
    else:  # mse against one-hot rows
        labels_fit = t.dtype not in ir.INT_DTYPES and t.shape == (s.shape[0], CLASSES)
    if labels_fit and input_side(s) is None:
        raise DataError(
            f"input `{stream.name}` is {s.describe()}: the embedded digits are square images, so it must be "
            f"[batch, side, side, channels] or side*side pixels wide (e.g. {NATIVE_SIDE * NATIVE_SIDE} for the "
            f"native {NATIVE_SIDE}x{NATIVE_SIDE} images, or 784 for 28x28, MNIST's size)"
            + (f", not {s.shape[1]}" if s.rank == 2 else f", not {s.shape[1]}x{s.shape[2]}")
        )
    return labels_fit


def _refusal(program: ir.Program) -> str:
    declared = ", ".join(f"`{i.name}`: {i.type.describe()}" for i in program.inputs)
    return (
        f"dslc train has no embedded data for spec `{program.name}` (inputs {declared}). It can feed "
        "(1) a byte-level language model: an integer input [batch, seq] read by an `embed` layer with at least "
        "128 ids, and integer targets of the same shape for `cross_entropy`; "
        "(2) a digit classifier: a float input [batch, side*side] or [batch, side, side, channels] and integer "
        "labels [batch] for `cross_entropy` "
        f"over at least {CLASSES} classes, or float targets [batch, {CLASSES}] (one-hot) for `mse`. "
        "No other inputs may be declared"
    )
