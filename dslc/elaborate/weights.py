"""Declare weights: what a layer's rule says it owns, split as its `shard` clauses say or read
from another layer's as its `tie` clauses say, a vocabulary padded to split evenly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.elaborate.flow import Walk
from dslc.elaborate.header import Header
from dslc.elaborate.ties import tied_weight
from dslc.elaborate.vocabulary import pad
from dslc.ir import nodes as ir
from dslc.ir.names import closest
from dslc.ir.shardings import resolve
from dslc.layers.base import Context, LayerRule, Vocabulary
from dslc.syntax import ast


def declare_weights(
    walk: Walk,
    rule: LayerRule[Any],
    a: object,
    attrs: dict[str, object],
    shards: tuple[ast.WeightShard, ...],
    ties: tuple[ast.WeightTie, ...],
    vocab: Vocabulary | None,
    path: str,
    span: Span,
    ctx: Context,
) -> list[ir.Weight] | None:
    """The weights of one use of `rule` at `path`: declared by the rule, split as its `shard`
    clauses say, read from another layer where `tie` clauses say, a vocabulary padded. None
    after reporting a clause that names no weight, or gives one twice or at the wrong rank."""
    specs = {w.name: w for w in rule.weights(a)}
    # A vocabulary's dimensions are padded to split evenly rather than refused (below).
    padded = dict(vocab.dims) if vocab is not None else {}
    given: dict[str, ast.WeightShard] = {}
    ok = True
    for shard in shards:
        wname = shard.weight.text
        possible = rule.possible_weights(attrs)
        if wname not in specs and wname in possible:
            # A weight other arguments would give this use (a bias turned off): the clause
            # applies where it exists, so one spec can switch it with a constant.
            continue
        if wname not in specs:
            _no_such_weight(walk.diags, rule, a, attrs, shard.weight, "E027", f"`{rule.kind}` has no weight `{wname}`")
            ok = False
        elif wname in given:
            _twice(walk.diags, "E027", f"weight `{wname}` is sharded twice", shard.span, given[wname].span, "sharded")
            ok = False
        elif len(shard.dims) != len(specs[wname].shape):
            dims = ", ".join(map(str, specs[wname].shape))
            walk.diags.error(
                "E027",
                f"weight `{wname}` of `{rule.kind}` has {len(specs[wname].shape)} dimensions [{dims}], "
                f"but the clause gives {len(shard.dims)}",
                shard.span,
                help="give one entry per dimension, `_` for replicated: "
                f"{wname}[{', '.join('_' for _ in specs[wname].shape)}]",
            )
            ok = False
        else:
            given[wname] = shard
    tied = _ties(rule, a, attrs, ties, given, walk.diags)
    ok = ok and tied is not None
    out = []
    reported = len(walk.diags.items)
    for spec in specs.values():
        written = given.get(spec.name)
        if any(n <= 0 for n in spec.shape):
            ok = False
            continue
        if tied and spec.name in tied:
            tie = tied[spec.name]
            w = tied_weight(tie, spec.shape, path, walk.declared, walk.depth > 0, walk.diags)
            ctx.weight_spans[spec.name] = tie.span
            if w is None:
                ok = False
            else:
                out.append(w)
            continue
        axis_sets = written.dims if written else tuple(ast.AxisSet((), span) for _ in spec.shape)
        what = f"weight `{path}.{spec.name}`"
        sizes = [None if padded.get(spec.name) == d else n for d, n in enumerate(spec.shape)]
        sharding = resolve(axis_sets, sizes, what, walk.header.mesh, walk.header.pipeline_axis, walk.diags)
        ctx.weight_spans[spec.name] = written.span if written else span
        t = ir.TensorType(walk.header.train.param_dtype, spec.shape, sharding)
        out.append(ir.Weight(spec.name, t, spec.initializer(), written.span if written else span))
    if len(walk.diags.items) > reported:
        ctx.shardings_as_written = False
    return pad(out, vocab, path, walk.header.mesh, walk.diags) if ok else None


def _ties(
    rule: LayerRule[Any],
    a: object,
    attrs: dict[str, object],
    ties: tuple[ast.WeightTie, ...],
    given: Mapping[str, ast.WeightShard],
    diags: Diagnostics,
) -> dict[str, ast.WeightTie] | None:
    """The `tie` clauses by weight name; None after reporting a clause that names a weight
    the layer lacks, ties one twice, or ties one also sharded (E032)."""
    specs = {w.name for w in rule.weights(a)}
    out: dict[str, ast.WeightTie] = {}
    ok = True
    for tie in ties:
        wname = tie.weight.text
        if wname not in specs and wname in rule.possible_weights(attrs):
            continue  # as for `shard`: a weight another setting would give this use
        if wname not in specs:
            _no_such_weight(diags, rule, a, attrs, tie.weight, "E032", f"`{rule.kind}` has no weight `{wname}` to tie")
            ok = False
        elif wname in out:
            _twice(diags, "E032", f"weight `{wname}` is tied twice", tie.span, out[wname].span, "tied")
            ok = False
        elif wname in given:
            diags.error(
                "E032",
                f"weight `{wname}` is tied and sharded: a tied weight is split as the weight it reads",
                given[wname].span,
                labels=[Label(tie.span, "tied here")],
                help=f"drop `{wname}` from the `shard` clause, and shard the weight it is tied to",
            )
            ok = False
        else:
            out[wname] = tie
    return out if ok else None


def _twice(diags: Diagnostics, code: str, message: str, span: Span, first: Span, done: str) -> None:
    diags.error(code, message, span, labels=[Label(first, f"first {done} here")])


def _no_such_weight(
    diags: Diagnostics,
    rule: LayerRule[Any],
    a: object,
    attrs: dict[str, object],
    name: ast.Ident,
    code: str,
    message: str,
) -> None:
    known = ", ".join(f"`{w.name}`" for w in rule.weights(a)) or "none"
    guess = closest(name.text, sorted(rule.possible_weights(attrs)))
    diags.error(
        code,
        message,
        name.span,
        notes=[f"its weights: {known}"],
        help=f"did you mean `{guess}`?" if guess else None,
    )


def check_shard_axes(shards: tuple[ast.WeightShard, ...], path: str, header: Header, diags: Diagnostics) -> None:
    """The axis names of a layer that could not be built: they need no shapes to check."""
    for shard in shards:
        what = f"weight `{path}.{shard.weight.text}`"
        resolve(shard.dims, [None] * len(shard.dims), what, header.mesh, header.pipeline_axis, diags)
