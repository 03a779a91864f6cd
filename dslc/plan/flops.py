"""Floating-point operations per training step, for the whole mesh.

Forward FLOPs come from the layer rules (`Layer.flops`, a multiply-add counting two).
The backward pass costs twice the forward (a gradient for the input and one for the
weights). Checkpointing adds a recomputation: `full` reruns the block's forward,
`selective` all of it but the saved layers. These three are the *model* FLOPs the papers
count. The pipeline executor also reruns each chunk's forward in its backward tick (it
stashes only chunk inputs), except the last chunk's, whose forward tick does no work:
that is reported apart, as `pipeline_recompute`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.ir.nodes import Block, Layer, Layout, Node, Program, Residual, layers


@dataclass(frozen=True, slots=True)
class Flops:
    forward: int
    backward: int
    recompute: int
    pipeline_recompute: int

    @property
    def model(self) -> int:
        """Forward, backward and checkpoint recomputation: the papers' FLOPs per iteration."""
        return self.forward + self.backward + self.recompute

    @property
    def total(self) -> int:
        return self.model + self.pipeline_recompute


def forward_flops(nodes: tuple[Node, ...]) -> int:
    return sum(layer.flops for layer in layers(nodes))


def _recomputed(node: Node) -> int:
    match node:
        case Layer() | Layout():
            return 0
        case Residual():
            return sum(_recomputed(n) for n in node.body)
        case Block():
            match node.remat.policy:
                case "none":
                    return sum(_recomputed(n) for n in node.body)
                case "full":
                    return forward_flops(node.body)
                case "selective":
                    saved = node.remat.saved
                    return sum(
                        layer.flops
                        for layer in layers(node.body)
                        if layer.path.rsplit(".", 1)[-1] not in saved and layer.path[len(node.path) + 1 :] not in saved
                    )
                case other:
                    assert_never(other)
        case _:
            assert_never(node)


def flops(program: Program) -> Flops:
    nodes = tuple(n for chunk in program.chunks for n in chunk.nodes)
    forward = forward_flops(nodes)
    recompute = sum(_recomputed(n) for n in nodes)
    p = program.pipeline
    pipelined = p is not None and program.mesh.size((p.axis,)) * p.virtual > 1
    rerun = sum(forward_flops(c.nodes) for c in program.chunks[:-1]) if pipelined else 0
    return Flops(forward, 2 * forward, recompute, rerun)
