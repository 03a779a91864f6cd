"""Tied weights: a layer's weight that is another layer's, stored once.

`lm_head: linear(d, vocab, bias=false) tie kernel = wte.table.T` makes the head's kernel the
embedding's table, read transposed: one array, initialised, stored, sharded and exported as
the table, whose gradient is the sum of both uses. The weight it names must be declared
above the tying layer, outside any repeat (a repeat's weight is one per layer), and the
tying layer must be at the top of `forward`, where every weight of the model is in reach
(a block's layers read only the block's own weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.ir import nodes as ir
from dslc.ir.names import closest
from dslc.syntax import ast

# The last part of a tie's target that reads the weight transposed: `wte.table.T`.
TRANSPOSED = "T"


@dataclass(frozen=True, slots=True)
class Declared:
    """A weight a tie may name: as its layer declared it, and whether it lies in a repeat."""

    weight: ir.Weight
    in_repeat: bool


def tied_weight(
    tie: ast.WeightTie,
    shape: tuple[int, ...],
    path: str,
    declared: Mapping[str, Declared],
    nested: bool,
    diags: Diagnostics,
) -> ir.Weight | None:
    """The weight `tie` makes of weight `tie.weight` of layer `path`, which declares it of
    `shape`; `declared` holds the weights above it by dotted name, `nested` says the layer is
    inside a block or repeat. None after reporting why it cannot be (E032, E033)."""
    what = f"`{path}.{tie.weight.text}`"
    if nested:
        diags.error(
            "E032",
            f"{what} is tied inside a block or repeat, whose layers read only their own weights",
            tie.span,
            help="tie the weight of a layer written at the top of `forward` (outside blocks and repeats)",
        )
        return None
    name, transposed = tie.path, False
    if name not in declared and len(tie.target) > 2 and tie.target[-1].text == TRANSPOSED:
        name, transposed = ".".join(i.text for i in tie.target[:-1]), True
    found = declared.get(name)
    if found is None:
        guess = closest(name, declared)
        diags.error(
            "E032",
            f"{what} is tied to `{tie.path}`, but no weight `{name}` is declared above it",
            _target_span(tie),
            notes=["a tie names a weight by its dotted path (`wte.table`), of a layer written before this one"],
            help=f"did you mean `{guess}`?" if guess else None,
        )
        return None
    if found.in_repeat:
        diags.error(
            "E032",
            f"{what} is tied to `{name}`, a weight of a repeat: each of its layers has its own",
            _target_span(tie),
            labels=[Label(found.weight.span, "declared here, inside a repeat")],
            help="tie to a weight of a layer outside any repeat",
        )
        return None
    stored = found.weight.stored
    # A tie to a tied weight reads the weight that one reads.
    if found.weight.tie is not None:
        name, transposed = found.weight.tie.name, transposed != found.weight.tie.transposed
    if transposed and stored.type.rank != 2:
        diags.error(
            "E033",
            f"{what} reads `{name}` transposed, but only a matrix can be: it is {_shape(stored.shape)}",
            _target_span(tie),
            labels=[Label(stored.span, "declared here")],
            help=f"drop the `.{TRANSPOSED}`",
        )
        return None
    # Shapes as declared: a padded vocabulary's padding is the stored weight's, and follows it.
    have = stored.shape[::-1] if transposed else stored.shape
    if have != shape:
        # Read the other way round, would it fit?
        turned = stored.type.rank == 2 and (stored.shape if transposed else stored.shape[::-1]) == shape
        diags.error(
            "E033",
            f"{what} is {_shape(shape)}, but `{tie.path}` it is tied to is {_shape(have)}",
            _target_span(tie),
            labels=[Label(stored.span, f"`{name}` declared here: {_shape(stored.shape)}")],
            help=(
                f"read it {'as it is: drop the `.T`' if transposed else f'transposed: `{name}.{TRANSPOSED}`'}"
                if turned
                else "make the two layers' sizes agree"
            ),
        )
        return None
    t = stored.type
    turn = (lambda dims: dims[::-1]) if transposed else (lambda dims: dims)
    return ir.Weight(
        tie.weight.text,
        ir.TensorType(t.dtype, turn(t.shape), turn(t.sharding)),
        stored.init,
        tie.span,
        tie=ir.Tie(name, stored, transposed),
        padding=turn(stored.padding),
    )


def _target_span(tie: ast.WeightTie) -> Span:
    first, last = tie.target[0].span, tie.target[-1].span
    return Span(first.file, first.line, first.column, last.end_line, last.end_column)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"
