"""Declare weights: what a layer's rule says it owns, split as its `shard` clauses say or read
from another layer's as its `tie` clauses say, a vocabulary padded to split evenly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dslc.diagnostics import Diagnostic, Diagnostics, Label, Span
from dslc.elaborate.flow import UnevenSplit, Walk
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
        before = len(walk.diags.items)
        sharding = resolve(axis_sets, sizes, what, walk.header.mesh, walk.header.pipeline_axis, walk.diags)
        _note_uneven(walk, walk.diags.items[before:], axis_sets, spec.shape, f"{path}.{spec.name}")
        ctx.weight_spans[spec.name] = written.span if written else span
        t = ir.TensorType(walk.header.train.param_dtype, spec.shape, sharding)
        out.append(ir.Weight(spec.name, t, spec.initializer(), written.span if written else span))
    if len(walk.diags.items) > reported:
        ctx.shardings_as_written = False
    return pad(out, vocab, path, walk.header.mesh, walk.diags) if ok else None


# Weights named in the note of a grouped E014; the labels still mark every one.
_LISTED = 8


def _note_uneven(
    walk: Walk, reported: Sequence[Diagnostic], axis_sets: Sequence[ast.AxisSet], shape: Sequence[int], weight: str
) -> None:
    """Keep the weight's dimensions that `resolve` just reported as not splitting evenly."""
    uneven = [d for d in reported if d.code == "E014"]
    if not uneven:
        return
    mesh = walk.header.mesh
    # The axes `resolve` kept on each dimension (known, not the pipeline's, used once), as it
    # decides them: asked again with no sizes, it checks the axes alone.
    kept = resolve(axis_sets, [None] * len(shape), weight, mesh, walk.header.pipeline_axis, Diagnostics())
    for d in uneven:
        dim = next(i for i, axis_set in enumerate(axis_sets) if axis_set.span == d.span)
        over = " x ".join(f"{a}={mesh.size((a,))}" for a in kept[dim])
        walk.uneven.append(UnevenSplit(d.span, d.message, weight, over, shape[dim]))


def report_uneven_once(uneven: Sequence[UnevenSplit], diags: Diagnostics) -> None:
    """Say each wrong mesh size once: the weights whose dimensions do not split evenly over the
    same axes (one `--mesh` typo can leave a dozen) become one E014, at the first of them in
    the source, whose note counts and names the others and whose labels mark each one.

    A place reported for several uses of one block counts once (they are one mistake, and the
    front end keeps one report per place anyway); a group of one place is left as it was."""
    groups: dict[str, dict[Span, UnevenSplit]] = {}
    for u in uneven:
        groups.setdefault(u.over, {}).setdefault(u.span, u)
    # What becomes of each grouped report, by place and message: its replacement, or None.
    becomes: dict[tuple[Span, str], Diagnostic | None] = {}
    for over, places in groups.items():
        if len(places) < 2:
            continue
        first, *rest = sorted(places.values(), key=lambda u: (u.span.file, u.span.line, u.span.column))
        names = ", ".join(f"`{u.weight}`" for u in rest[:_LISTED]) + (", ..." if len(rest) > _LISTED else "")
        more = f"{len(rest)} more weight{'s' if len(rest) > 1 else ''}"
        verb = "do" if len(rest) > 1 else "does"
        note = f"and {more} split over {over} {verb} not divide evenly: {names}"
        labels = tuple(Label(u.span, f"`{u.weight}`: {u.size}") for u in rest)
        for u in uneven:
            if u.over == over:
                becomes[(u.span, u.message)] = None
        # The first report as it stands now (a block's use may have labelled it since).
        now = next(d for d in diags.items if d.code == "E014" and (d.span, d.message) == (first.span, first.message))
        becomes[(first.span, first.message)] = replace(now, labels=(*now.labels, *labels), notes=(*now.notes, note))
    if becomes:
        kept = (becomes.get((d.span, d.message), d) if d.code == "E014" else d for d in diags.items)
        diags.items = [d for d in kept if d is not None]


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
    have = {w.name for w in rule.weights(a)}
    known = ", ".join(f"`{w.name}`" for w in rule.weights(a)) or "none"
    guess = closest(name.text, sorted(rule.possible_weights(attrs)))
    help = f"did you mean `{guess}`?" if guess else None
    if help is not None and guess not in have:
        # A weight of the kind that this use's arguments leave out (a bias under bias=false).
        toggles = [
            arg.name
            for arg in rule.args
            if arg.type == "bool"
            and guess in {w.name for w in rule.weights(rule.parse({**attrs, arg.name: not attrs[arg.name]}))}
        ]
        if toggles:
            help += f" This use has none: `{toggles[0]}={str(attrs[toggles[0]]).lower()}` leaves it out."
    diags.error(code, message, name.span, notes=[f"its weights: {known}"], help=help)


def check_shard_axes(shards: tuple[ast.WeightShard, ...], path: str, header: Header, diags: Diagnostics) -> None:
    """The axis names of a layer that could not be built: they need no shapes to check."""
    for shard in shards:
        what = f"weight `{path}.{shard.weight.text}`"
        resolve(shard.dims, [None] * len(shard.dims), what, header.mesh, header.pipeline_axis, diags)
