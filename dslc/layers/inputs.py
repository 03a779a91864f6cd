"""What values a program's inputs may hold, and the check of a batch against them.

Nothing here needs jax: `Program` checks every batch it is given with `check_inputs`, and so
do `dslc run` and `dslc train` through it. A value the spec cannot mean (a token id past the
vocabulary, a negative class label, fractions where the spec declares integers) would
otherwise be clamped or cast silently, and the numbers computed from it would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslc.ir import nodes as ir
from dslc.layers import RULES, args
from dslc.layers.attention import Attention
from dslc.layers.dense import Embed
from dslc.layers.loss import CrossEntropy, MeanSquaredError

# The values each integer dtype can hold.
_INT_LIMITS = {"i8": (-(2**7), 2**7 - 1), "i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}


class InputError(ValueError):
    """A batch that does not fit the spec's inputs: a name, shape, dtype or value."""


@dataclass(frozen=True, slots=True)
class IdRange:
    """Integer input values must lie in 0 .. `bound` - 1, or be `ignored` (a target the loss
    does not count); `what` says which layer reads them."""

    bound: int
    what: str
    ignored: int | None = None


@dataclass(frozen=True, slots=True)
class Packing:
    """How a language model's sequences hold several documents: the input of document ids its
    attention layers read (`segments=`, one for all: `readers`), and the loss's mask
    (`mask=`), which packing fills with where a target stays in its document."""

    segments: str | None
    readers: tuple[str, ...]
    mask: str | None

    def describe(self) -> str:
        """One sentence for `dslc show` and `dslc plan`; empty when nothing is packed."""
        said = []
        if self.segments is not None:
            said.append(
                f"{', '.join(f'`{r}`' for r in self.readers)} read document ids from `{self.segments}` "
                "(a query sees only its own document's keys, rotary positions restart at each)"
            )
        if self.mask is not None:
            said.append(f"the loss counts only positions where `{self.mask}` is not 0 (not a next document's first)")
        return "documents packed into sequences: " + "; ".join(said) if said else ""


# A program whose sequences are one document each.
UNPACKED = Packing(None, (), None)


def packing(program: ir.Program) -> Packing:
    """The inputs that pack documents into `program`'s sequences (none: `UNPACKED`)."""
    readers: dict[str, list[str]] = {}
    for layer in ir.all_layers(program):
        segments = args(layer, Attention).segments if layer.kind == Attention.kind else None
        if segments is not None:
            readers.setdefault(str(segments), []).append(layer.path)
    loss = program.loss
    mask = args(loss, CrossEntropy).mask if loss is not None and loss.kind == CrossEntropy.kind else None
    segments = next(iter(readers)) if len(readers) == 1 else None
    return Packing(segments, tuple(readers.get(segments, ())) if segments else (), None if mask is None else str(mask))


def id_ranges(program: ir.Program) -> dict[str, IdRange]:
    """For integer inputs that index something: token ids below the embedding's vocabulary,
    class labels below the logits' width."""
    ranges: dict[str, IdRange] = {}
    for source, layer in _layers_by_source(program):
        if layer.kind == Embed.kind and layer.input.dtype in ir.INT_DTYPES and source not in ranges:
            vocab = args(layer, Embed).vocab
            ranges[source] = IdRange(vocab, f"`{layer.path}` takes token ids 0 .. {vocab - 1} (vocab {vocab})")
        if layer.kind == CrossEntropy.kind:
            # Logits past `classes` are a padded vocabulary's: no target names them.
            loss = args(layer, CrossEntropy)
            classes = loss.classes or layer.input.shape[-1]
            ignored = loss.ignore_index
            what = f"`{layer.path}` takes class ids 0 .. {classes - 1} ({classes} logits), or {ignored} (not counted)"
            ranges[loss.targets] = IdRange(classes, what, ignored)
    return ranges


def _layers_by_source(program: ir.Program) -> list[tuple[str, ir.Layer]]:
    """Every layer with the input its activation comes from: a stream's layers from the
    stream's source, the others from the input `forward` reads."""
    streams = [(stream.source, layer) for stream in program.streams for layer in ir.layers(stream.body)]
    inside = {id(layer) for _, layer in streams}
    return [*streams, *((program.stream, layer) for layer in ir.all_layers(program) if id(layer) not in inside)]


def integer_bounds(program: ir.Program) -> dict[str, int]:
    """For integer inputs, the exclusive upper bound of a valid value (see `id_ranges`)."""
    return {name: r.bound for name, r in id_ranges(program).items()}


def loss_targets(loss: ir.Layer) -> str:
    """The input a loss layer compares the activation with."""
    if loss.kind == CrossEntropy.kind:
        return args(loss, CrossEntropy).targets
    return args(loss, MeanSquaredError).targets


def read_inputs(program: ir.Program, loss: bool) -> tuple[str, ...]:
    """The inputs the forward pass reads (its own and its streams'), and with `loss` the
    loss's targets."""
    names = [program.stream, *(s.source for s in program.streams if s.source != program.stream)]
    nodes = [n for chunk in program.chunks for n in chunk.nodes]
    last = nodes[-1] if nodes else None
    if loss and isinstance(last, ir.Layer) and RULES[last.kind].is_loss:
        names.append(loss_targets(last))
    return tuple(names)


def check_inputs(program: ir.Program, batch: Mapping[str, Any], required: tuple[str, ...]) -> None:
    """Raise InputError, in one line naming the input, when a `required` input is missing or
    any declared input in `batch` has another shape, a dtype of another kind (fractions for
    an integer input), or a value outside what its reader accepts (with its index)."""
    import numpy as np

    missing = [name for name in required if name not in batch]
    if missing:
        given = ", ".join(f"`{n}`" for n in batch) or "nothing"
        raise InputError(f"missing input `{missing[0]}` (the batch holds {given})")
    ranges = id_ranges(program)
    for inp in program.inputs:
        if inp.name not in batch:
            continue
        value = np.asarray(batch[inp.name])
        if value.shape != inp.type.shape:
            raise InputError(f"input `{inp.name}` has shape {value.shape}, the spec says {inp.type.shape}")
        integer = inp.type.dtype in ir.INT_DTYPES
        if integer and not np.issubdtype(value.dtype, np.integer):
            raise InputError(
                f"input `{inp.name}` is {inp.type.dtype} in the spec, but the array holds {value.dtype} values; "
                "give it integers"
            )
        # bfloat16 (ml_dtypes, as jax writes it) is a number numpy does not count among its own.
        numeric = np.issubdtype(value.dtype, np.number) or value.dtype.name.startswith(("bfloat", "float"))
        if not integer and not (numeric or value.dtype == np.bool_):
            raise InputError(f"input `{inp.name}` is {inp.type.dtype} in the spec, but the array holds {value.dtype}")
        if not integer or value.size == 0:
            continue
        lo, hi = _INT_LIMITS[inp.type.dtype]
        what = f"that does not fit {inp.type.dtype}"
        ignored = None
        if inp.name in ranges:
            lo, hi, what, ignored = 0, ranges[inp.name].bound - 1, ranges[inp.name].what, ranges[inp.name].ignored
        outside = (value < lo) | (value > hi)
        if ignored is not None:
            outside &= value != ignored
        bad = np.flatnonzero(outside)
        if bad.size:
            index = np.unravel_index(bad[0], value.shape)
            where = ", ".join(str(int(i)) for i in index)
            more = f" (and {bad.size - 1} more out of range)" if bad.size > 1 else ""
            raise InputError(f"input `{inp.name}` holds {value[index]} at index [{where}]{more}: {what}")
