"""Floating-point operations per training step, for the whole mesh.

Forward FLOPs come from the layer rules (`Layer.flops`, by the convention `LayerRule.flops`
states: a multiply-add counts two, an elementwise operation one per element, a bias add
among them), a repeat's layers counted once per copy. The backward pass costs twice the
forward (a gradient for the input and one for the weights). Checkpointing adds a
recomputation: `full` reruns the block's forward, `selective` all of it but the saved layers.
These three are the *model* FLOPs the papers count. The pipeline executor keeps each chunk's
residuals from its forward tick to its backward tick, so it reruns nothing — except under a
schedule that splits the backward (zb-h1, zb-v, v-half, or a table with I and W actions): its
weight-gradient tick pulls the output gradient through the chunk again, about one forward's
worth more, reported apart as `pipeline_recompute`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.ir.nodes import (
    Block,
    Branches,
    Layer,
    Layout,
    Node,
    Program,
    Repeat,
    Residual,
    Stream,
    counted_layers,
    own_layers,
)
from dslc.ir.schedule import splits_backward, stage_of
from dslc.layers import RULES


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
    return sum(layer.flops * times for layer, times in counted_layers(nodes))


def _recomputed(node: Node) -> int:
    match node:
        case Layer() | Layout():
            return 0
        case Residual() | Branches() | Stream():
            return sum(_recomputed(n) for n in node.body)
        case Repeat():
            return node.count * _recomputed(node.body)
        case Block():
            match node.remat.policy:
                case "none":
                    return sum(_recomputed(n) for n in node.body)
                case "full":
                    return forward_flops(node.body)
                case "selective":
                    return sum(
                        layer.flops * times
                        for layer, times in counted_layers(node.body)
                        if layer.path not in node.remat.saved
                    )
                case "core_attention":
                    return sum(_recomputed(n) for n in node.body) + recomputed_cores(node)
                case other:
                    assert_never(other)
        case _:
            assert_never(node)


def recomputed_cores(block: Block) -> int:
    """`checkpoint core_attention`: the backward pass reruns the cores of the block's own
    attention layers (their scores), once per forward."""
    return sum(RULES[layer.kind].core_flops(layer) for layer in own_layers(block.body))


def flops(program: Program) -> Flops:
    nodes = program.nodes
    forward = forward_flops(nodes)
    recompute = sum(_recomputed(n) for n in nodes)
    return Flops(forward, 2 * forward, recompute, forward if splits_backward(program) else 0)


def busiest_stage_flops(program: Program) -> float:
    """FLOPs per device on the busiest pipeline stage: each stage's share of the step's FLOPs
    (the model's, and a split backward's second pull) spread over the devices that run it."""
    stages = program.stages
    split = splits_backward(program)
    per_stage = [0] * stages
    stage = stage_of(program)
    for chunk in program.chunks:
        forward = forward_flops(chunk.nodes)
        recompute = sum(_recomputed(n) for n in chunk.nodes)
        per_stage[stage[chunk.index]] += 3 * forward + recompute + (forward if split else 0)
    return max(per_stage) / (program.mesh.devices // stages)
