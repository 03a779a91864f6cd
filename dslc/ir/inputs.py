"""What values a program's inputs may hold."""

from __future__ import annotations

from dslc.ir import nodes as ir


def integer_bounds(program: ir.Program) -> dict[str, int]:
    """For integer inputs, the exclusive upper bound of a valid value: token ids below the
    embedding's vocabulary, class labels below the logits' width."""
    bounds: dict[str, int] = {}
    for layer in ir.all_layers(program):
        if layer.kind == "embed" and layer.input.dtype in ir.INT_DTYPES:
            bounds.setdefault(program.stream, int(layer.attr("vocab")))  # type: ignore[call-overload]
        if layer.kind == "cross_entropy":
            bounds[str(layer.attr("targets"))] = layer.input.shape[-1]
    return bounds
