"""Infer a layer: one use of a built-in layer typed by its rule — the shape and sharding of its
output, the collectives it implies, its FLOPs."""

from __future__ import annotations

from typing import Any

from dslc.diagnostics import Span
from dslc.elaborate.arguments import bind_arguments
from dslc.elaborate.flow import UNKNOWN, Flow, Scope, Walk
from dslc.elaborate.ties import Declared
from dslc.elaborate.weights import check_shard_axes, declare_weights
from dslc.ir import nodes as ir
from dslc.layers.base import Context, LayerRule, input_args
from dslc.syntax import ast


def infer_layer(
    walk: Walk,
    rule: LayerRule[Any],
    call: ast.Call,
    shards: tuple[ast.WeightShard, ...],
    ties: tuple[ast.WeightTie, ...],
    path: str,
    flow: Flow,
    scope: Scope,
    span: Span,
) -> ir.Node | None:
    """The use of `rule` at `path` called by `call`: its arguments bound, its weights declared,
    its output typed by the rule from the activation `flow` carries, which it updates. None
    after reporting arguments the rule refuses."""
    arg_spans: dict[str, Span] = {}
    written: dict[str, str] = {}
    attrs = bind_arguments(
        rule.args,
        call,
        scope,
        f"`{rule.kind}`",
        walk.header.inputs,
        walk.diags,
        spans=arg_spans,
        streams=walk.streams,
        spellings=walk.spellings[-1] if walk.spellings else None,
        written=written,
    )
    takes_classes = "classes" in {arg.name for arg in rule.args}
    if attrs is not None and flow.classes is not None and takes_classes and "classes" not in arg_spans:
        # The loss after a padded head counts only the real classes.
        attrs["classes"] = flow.classes
    # Parsed once, for every question put to the rule about this use.
    a = rule.parse(attrs) if attrs is not None else None
    ctx = Context(
        mesh=walk.header.mesh,
        path=path,
        span=call.span,
        input_span=flow.span,
        inputs=walk.readable,
        compute_dtype=walk.header.train.compute_dtype,
        diags=walk.diags,
        arg_spans=arg_spans,
    )
    if attrs is None or a is None or not rule.validate(a, ctx):
        check_shard_axes(shards, path, walk.header, walk.diags)
        flow.type, flow.span = UNKNOWN, span
        return None
    vocab = rule.vocabulary(a, id(call) in walk.heads)
    weights = declare_weights(walk, rule, a, attrs, shards, ties, vocab, path, call.span, ctx)
    for w in weights or ():
        walk.declared[f"{path}.{w.name}"] = Declared(w, walk.repeats > 0)
    x = flow.type
    y = UNKNOWN
    # A layer that reads a declared input (a loss's targets) or a stream compares it with
    # the activation, which comes from the input the body reads. An unreadable target leaves nothing
    # to compare; a refused sharding on either side leaves shapes, but not shardings.
    read = input_args(rule, attrs)
    reads = set(read.values())
    if reads and (reads | {walk.stream}) & walk.header.broken_inputs:
        ctx.shardings_as_written = False
    read_types = {arg: walk.readable[name].type for arg, name in read.items()}
    if x is not UNKNOWN and weights is not None and not reads & walk.untyped:
        typed = rule.infer(a, x, {w.name: w.type for w in weights}, ctx)
        y = typed if typed is not None else UNKNOWN
    node = ir.Layer(
        path=path,
        kind=rule.kind,
        attrs=tuple(attrs.items()),
        weights=tuple(weights or ()),
        input=x,
        output=y,
        collectives=tuple(ctx.collectives),
        flops=rule.flops_reading(a, x, y, read_types) if y is not UNKNOWN else 0,
        operand=ctx.operand if ctx.operand is not None else x.sharding,
        span=span,
        reads=tuple(read_types.items()),
        written=tuple(written.items()),
    )
    flow.type, flow.span = y, span
    widened = vocab is not None and vocab.logits and y is not UNKNOWN and y.shape[-1] != vocab.size
    flow.classes = vocab.size if vocab is not None and widened else None
    if rule.is_loss:
        flow.after_loss = span
    return node
