"""Elaboration: from what was written (AST) to what it means (IR).

Runs in the order a reader resolves a spec, one step a module:

1. `header`: read the header (model, mesh, constants, inputs, training settings, blocks);
2. `body`: instantiate the forward body — blocks expanded, repeats elaborated once — where
   each statement is named (`names`), its arguments bound (`arguments`), a layer's weights
   declared (`weights`, with `ties` and `vocabulary`) and its output typed by its layer rule
   (`infer`), a `layout` applied (`layouts`), a block's checkpoint resolved (`checkpoints`);
3. `chunks`: assign the body to the pipeline's chunks and stages.

Every problem is reported where it was written and elaboration goes on, so one run finds
them all. The package sits above both the IR and the layer rules: the IR imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dslc.diagnostics import Diagnostics, Span
from dslc.elaborate.body import instantiate
from dslc.elaborate.chunks import assign_chunks
from dslc.elaborate.header import read_constants, read_header
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue
from dslc.ir.settings import read_pipeline
from dslc.layers import RULES
from dslc.syntax import ast

__all__ = ["elaborate", "read_constants"]


def elaborate(
    module: ast.Module,
    mesh_sizes: Sequence[int] | None,
    diags: Diagnostics,
    overrides: Mapping[str, ScalarValue] | None = None,
) -> ir.Program | None:
    """The program a module denotes, or None when it is too broken to say.

    `overrides` replaces the values of named constants (`--set layers=4`); constants defined
    from them follow.
    """
    if not module.items:
        diags.error(
            "E028",
            "the spec is empty",
            module.span,
            help="a spec needs at least `model NAME`, an `input` and a `forward(INPUT) { ... }` body",
        )
        return None
    header = read_header(module, mesh_sizes, diags, overrides or {})
    if header.forward is None:
        # Where the body would go: after the last item. (Not the whole file, which is where a
        # missing `model` is reported: one report per code and span is kept.)
        last = module.items[-1].span
        diags.error(
            "E028",
            "the spec has no `forward(...) { ... }` body",
            Span(last.file, last.end_line, last.end_column, last.end_line, last.end_column + 1),
            help="add `forward(INPUT) { ...layers... }` naming the input the layers read",
        )
        return None
    body = instantiate(header.forward, header, diags)
    if body is None:
        return None
    segments = body.segments
    pipeline = read_pipeline(header.pipeline, header.mesh, header.constants, diags) if header.pipeline else None
    if header.pipeline is not None and pipeline is None:
        # The pipeline was declared but could not be read (already reported): the stages
        # cannot be counted against it, and "no pipeline is declared" would be untrue.
        chunks: tuple[ir.Chunk, ...] = (ir.Chunk(0, 0, 0, tuple(n for s in segments for n in s.nodes)),)
    else:
        chunks = assign_chunks(segments, pipeline, header.mesh, diags, body.misplaced_stages)
    final = chunks[-1].nodes[-1] if chunks and chunks[-1].nodes else None
    return ir.Program(
        name=header.name,
        mesh=header.mesh,
        constants=tuple(header.constants.items()),
        inputs=tuple(header.inputs.values()),
        stream=body.stream,
        chunks=chunks,
        pipeline=pipeline,
        train=header.train,
        loss=final if isinstance(final, ir.Layer) and RULES[final.kind].is_loss else None,
        span=module.span,
    )
