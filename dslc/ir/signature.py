"""What a subtree of the IR computes, apart from where it sits and which layers it names."""

from __future__ import annotations

from typing import assert_never

from dslc.ir import nodes as ir


def signature(node: ir.Node, prefix: str | None = None) -> object:
    """Everything about a subtree except its place: two subtrees with equal signatures compute
    the same function of their own weights (the code generator gives them one class). A
    repeat's share of its run (which layers a pipeline chunk runs) is not part of it."""
    if prefix is None:
        prefix = node.path + "."
    # The subtree's own root sits at "" (its path is the prefix without its dot).
    relative = node.path[len(prefix) :] if node.path.startswith(prefix) else ""
    match node:
        case ir.Layer():
            return (
                "layer",
                relative,
                node.kind,
                node.attrs,
                # A tied weight is read from the array it names, perhaps transposed.
                tuple((w.name, w.type, w.tie and (w.tie.name, w.tie.transposed)) for w in node.weights),
                node.input,
                node.output,
                node.operand,
            )
        case ir.Layout():
            return ("layout", node.input, node.output)
        case ir.Repeat():
            return ("repeat", relative, node.count, signature(node.body, prefix))
        case ir.Branches():
            arms = tuple(tuple(signature(c, prefix) for c in arm) for arm in node.arms)
            return ("branches", relative, node.input, node.output, arms)
        case ir.Stream():
            body = tuple(signature(c, prefix) for c in node.body)
            return ("stream", relative, node.source, node.result, body)
        case ir.Residual() | ir.Block():
            remat = node.remat if isinstance(node, ir.Block) else None
            saved = tuple(p[len(prefix) :] for p in remat.saved) if remat else ()
            return (
                type(node).__name__,
                relative,
                remat.policy if remat else None,
                saved,
                node.input,
                node.output,
                tuple(signature(c, prefix) for c in node.body),
            )
        case _:
            assert_never(node)


def chunk_signature(nodes: tuple[ir.Node, ...]) -> object:
    """A pipeline chunk's signature: chunks with equal ones share a class."""
    return tuple(signature(n, "") for n in nodes)
