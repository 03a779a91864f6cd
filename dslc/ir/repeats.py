"""Runs of identical blocks (a `repeat`): both backends execute each run as one loop."""

from __future__ import annotations

from typing import assert_never

from dslc.ir import nodes as ir


def group_repeats(nodes: tuple[ir.Node, ...]) -> list[tuple[ir.Node, ...]]:
    """Consecutive blocks that differ only in their names (a `repeat`), grouped into runs."""
    runs: list[list[ir.Node]] = []
    for node in nodes:
        if runs and isinstance(node, ir.Block) and signature(node) == signature(runs[-1][0]):
            runs[-1].append(node)
        else:
            runs.append([node])
    return [tuple(run) for run in runs]


def signature(node: ir.Node, prefix: str | None = None) -> object:
    """Everything about a subtree except where it sits: two blocks with equal signatures
    compute the same function of their own weights."""
    if prefix is None:
        prefix = node.path + "."
    relative = node.path[len(prefix) :] if node.path.startswith(prefix) else node.path
    match node:
        case ir.Layer():
            return (
                "layer",
                relative,
                node.kind,
                node.attrs,
                tuple((w.name, w.type) for w in node.weights),
                node.input,
                node.output,
                node.operand,
            )
        case ir.Layout():
            return ("layout", node.input, node.output)
        case ir.Residual() | ir.Block():
            remat = node.remat if isinstance(node, ir.Block) else None
            return (
                type(node).__name__,
                remat,
                node.input,
                node.output,
                tuple(signature(c, prefix) for c in node.body),
            )
        case _:
            assert_never(node)
