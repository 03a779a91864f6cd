"""Vocabulary padding: a vocabulary that does not split evenly over its mesh axes is padded.

GPT-2's 50257 tokens do not divide a tensor-parallel axis of 2. Rather than refuse the split
(E014), the compiler pads the vocabulary dimensions of the layers that index it (a layer
rule's `vocabulary`) to the next size every split of them divides: an embedding's table gets
rows no token id selects, and a head feeding a loss that masks padding (cross-entropy's
`classes`) gets outputs the loss leaves out of its softmax, so the loss and every gradient
are the unpadded model's. Padding is stored, zero and trained to stay zero, and never
exported: weights go in and out at the shapes the spec declares. `dslc plan` says what it
costs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from dslc.diagnostics import Diagnostics
from dslc.ir import nodes as ir
from dslc.layers import RULES
from dslc.layers.base import Vocabulary
from dslc.syntax import ast


def feeding_masked_losses(body: Sequence[ast.Stmt]) -> set[int]:
    """The calls (by id) of the layers in `forward` written right before a loss that masks
    padded logits out: heads whose outputs may be padded. `stage` and `stages` are
    transparent: a head after the stages still feeds the loss after it."""
    flat: list[ast.Stmt] = []
    for stmt in body:
        flat.extend(stmt.body if isinstance(stmt, ast.StageStmt | ast.StagesStmt) else (stmt,))
    return {
        id(stmt.call)
        for stmt, after in itertools.pairwise(flat)
        if isinstance(stmt, ast.LayerStmt)
        and isinstance(after, ast.LayerStmt)
        and after.call.callee.text in RULES
        and RULES[after.call.callee.text].masks_padding
    }


def padded_size(size: int, pieces: int) -> int:
    """`size` rounded up to a multiple of `pieces`."""
    return -(-size // pieces) * pieces


def pad(
    weights: list[ir.Weight], vocab: Vocabulary | None, path: str, mesh: ir.Mesh, diags: Diagnostics
) -> list[ir.Weight] | None:
    """The layer's weights with the vocabulary's dimensions (if it has one) padded to one size
    that all their splits divide (a tied weight comes padded already: the others follow it).
    None after reporting a tied weight padded where this layer cannot mask it (E033)."""
    dims = dict(vocab.dims) if vocab is not None else {}
    own = [(w, dims[w.name]) for w in weights if w.name in dims and w.tie is None]
    pieces = math.lcm(*(mesh.size(w.type.sharding[d]) for w, d in own)) if own else 1
    size = padded_size(vocab.size, pieces) if vocab is not None else 0
    for w in weights:
        if w.tie is None or not any(w.padding):
            continue
        at = [d for d, extra in enumerate(w.padding) if extra]
        padded_to = w.type.shape[at[0]]
        if at != [dims.get(w.name)] or padded_to % pieces:
            diags.error(
                "E033",
                f"`{path}.{w.name}` reads `{w.tie.name}`, whose vocabulary is padded to {padded_to}, "
                "where this layer cannot leave the padding out",
                w.span,
                notes=[
                    "a vocabulary that does not split evenly is padded: an embedding's extra rows are never "
                    "read, and a head's extra outputs are masked out by the cross_entropy right after it"
                ],
                help="tie it in a head that feeds cross_entropy, or split the vocabulary over axes that divide it",
            )
            return None
        size = padded_to
    if vocab is None or size == vocab.size:
        return weights
    out = []
    for w in weights:
        if w.name not in dims or w.tie is not None:
            out.append(w)
            continue
        d = dims[w.name]
        shape = tuple(size if i == d else n for i, n in enumerate(w.type.shape))
        padding = tuple(size - n if i == d else 0 for i, n in enumerate(w.type.shape))
        out.append(replace(w, type=ir.TensorType(w.type.dtype, shape, w.type.sharding), padding=padding))
    return out
