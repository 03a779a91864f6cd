"""Activation memory per device: what the forward pass keeps for the backward pass.

The model, checkpoint policy by checkpoint policy (see docs/plan.md):

* `checkpoint none` (and code outside any block): every layer keeps what its backward needs
  (`residuals.layer_residuals`: operands of matrix products, f32 copies in norms and the
  loss, attention probabilities [b, heads, s, s] in f32, the embedding's one-hot matrix).
* `checkpoint full`: a block keeps only its input; its backward recomputes the block, so one
  block's residuals exist again, transiently, while that block's backward runs.
* `checkpoint selective(names)`: the block input plus the outputs of the named layers, with
  the same transient recompute.

On top of what is kept, the backward pass needs a transient working set: the largest layer's
residual gradients (`residuals.layer_workspace`), or a recomputed block's whole residuals.
Total activation memory = kept + the largest transient.

Under a pipeline the lowering differs (dslc/lower/pipeline.py): each stage stashes only chunk
inputs, in as many slots as the schedule's buffer plan needs, and a backward tick recomputes
its chunk's forward from the stash; the checkpoint policy then only shapes that one chunk's
transient, for one microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.ir.nodes import DTYPE_BYTES, Block, Layer, Layout, Mesh, Node, Residual, TensorType, layers
from dslc.plan.residuals import layer_residuals, layer_workspace, local_numel, weight_copies


@dataclass(frozen=True, slots=True)
class Kept:
    """Bytes held until the backward pass reaches them, and the most held at any moment of
    that backward pass (what is kept plus the working set of the node being differentiated)."""

    kept: int = 0
    peak: int = 0


def tensor_bytes(t: TensorType, mesh: Mesh, slices: int) -> int:
    return local_numel(t, mesh, slices) * DTYPE_BYTES[t.dtype]


def kept_by(nodes: tuple[Node, ...], mesh: Mesh, compute: str, slices: int) -> Kept:
    """What running `nodes` forward keeps for their backward pass, on one device.

    The backward pass visits the nodes last to first, freeing each node's residuals once it
    is done, so while node i is differentiated the residuals of nodes before it are still
    held: the peak is the largest (kept by nodes before i) + (node i's own peak).
    """
    kept = peak = 0
    for node in nodes:
        one = _kept_by_node(node, mesh, compute, slices)
        peak = max(peak, kept + one.peak)
        kept += one.kept
    return Kept(kept, max(peak, kept))


def _kept_by_node(node: Node, mesh: Mesh, compute: str, slices: int) -> Kept:
    match node:
        case Layer():
            cast = any(w.type.dtype != compute for w in node.weights)
            copies = weight_copies(node, mesh, compute) if cast else 0
            kept = layer_residuals(node, mesh, compute, slices) + copies
            return Kept(kept, kept + layer_workspace(node, mesh, compute, slices))
        case Residual():
            return kept_by(node.body, mesh, compute, slices)
        case Layout():
            return Kept()
        case Block():
            inner = kept_by(node.body, mesh, compute, slices)
            match node.remat.policy:
                case "none":
                    return inner
                case "full":
                    held = tensor_bytes(node.input, mesh, slices)
                    return Kept(held, held + inner.peak)
                case "selective":
                    held = tensor_bytes(node.input, mesh, slices) + sum(
                        tensor_bytes(layer.output, mesh, slices)
                        for layer in layers(node.body)
                        if _is_saved(node, layer)
                    )
                    return Kept(held, held + inner.peak)
                case other:
                    assert_never(other)
        case _:
            assert_never(node)


def _is_saved(block: Block, layer: Layer) -> bool:
    """The lowering's rule for `selective(names)`: a name matches a layer's path below the
    block, or the last part of it."""
    relative = layer.path[len(block.path) + 1 :] if layer.path.startswith(block.path + ".") else layer.path
    return relative in block.remat.saved or layer.path.rsplit(".", 1)[-1] in block.remat.saved


def scan_runs(nodes: tuple[Node, ...]) -> list[tuple[Block, ...]]:
    """Runs of identical consecutive blocks (a `repeat`), which the lowering turns into one
    `lax.scan` over stacked weights; found at any depth."""
    runs: list[tuple[Block, ...]] = []
    current: list[Block] = []

    def flush() -> None:
        if len(current) > 1:
            runs.append(tuple(current))
        current.clear()

    for node in nodes:
        if isinstance(node, Block) and current and _same_shape(current[0], node):
            current.append(node)
            continue
        flush()
        if isinstance(node, Block):
            current.append(node)
        if isinstance(node, Block | Residual):
            runs.extend(scan_runs(node.body))
    flush()
    return runs


def _same_shape(a: Block, b: Block) -> bool:
    return (
        a.block == b.block
        and a.remat == b.remat
        and a.input == b.input
        and a.output == b.output
        and [_layer_shape(x) for x in layers(a.body)] == [_layer_shape(x) for x in layers(b.body)]
    )


def _layer_shape(layer: Layer) -> object:
    return (layer.kind, layer.attrs, tuple(w.type for w in layer.weights))
