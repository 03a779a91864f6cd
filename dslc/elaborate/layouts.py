"""Relayout the activation: a `layout` statement re-splits it, gathering what it no longer
splits; a row-parallel sum right before it that it re-splits becomes a reduce-scatter."""

from __future__ import annotations

from dataclasses import replace

from dslc.diagnostics import Diagnostics, Label
from dslc.elaborate.flow import UNKNOWN, Flow
from dslc.elaborate.header import Header
from dslc.ir import nodes as ir
from dslc.ir.shardings import resolve
from dslc.syntax import ast


def relayout(stmt: ast.LayoutStmt, flow: Flow, prefix: str, header: Header, diags: Diagnostics) -> ir.Layout:
    """The `layout` statement applied to the activation `flow` carries, which it updates."""
    x = flow.type
    path = prefix + "layout"
    if x is UNKNOWN:
        return ir.Layout(path, x, x, (), stmt.span)
    if len(stmt.dims) != x.rank:
        diags.error(
            "E016",
            f"`layout` gives {len(stmt.dims)} dimensions, but the activation here has {x.rank}: {x.describe()}",
            stmt.span,
            labels=[Label(flow.span, "activation produced here")],
        )
        return ir.Layout(path, x, x, (), stmt.span)
    sharding = resolve(stmt.dims, x.shape, "the activation", header.mesh, header.pipeline_axis, diags)
    y = ir.TensorType(x.dtype, x.shape, sharding)
    collectives = []
    for old, new in zip(x.sharding, y.sharding, strict=True):
        gone = tuple(a for a in old if a not in new)
        if gone and header.mesh.size(gone) > 1:
            collectives.append(ir.Collective("all-gather", gone, x.numel, x.dtype, "`layout`: gather the activation"))
    flow.type, flow.span = y, stmt.span
    return ir.Layout(path, x, y, tuple(collectives), stmt.span)


def fuse_reduce_scatter(layer: ir.Layer, layout: ir.Layout) -> ir.Layer:
    """A row-parallel sum re-split over the same axes right after is one reduce-scatter.

    Megatron's sequence parallelism: the partial sums of a row-parallel layer need only
    reach the device that keeps each slice of tokens, which moves half the bytes of an
    all-reduce (XLA on CPU still spells it all-reduce + slice).
    """
    if not layer.collectives or layer.collectives[-1].kind != "all-reduce":
        return layer
    summed = layer.collectives[-1]
    added = [
        tuple(a for a in new if a not in old)
        for old, new in zip(layout.input.sharding, layout.output.sharding, strict=True)
    ]
    if [axes for axes in added if axes] != [summed.axes] or layout.collectives:
        return layer
    scatter = ir.Collective(
        "reduce-scatter", summed.axes, summed.elements, summed.dtype, summed.why.replace("sum", "sum and re-split")
    )
    return replace(layer, collectives=(*layer.collectives[:-1], scatter))
