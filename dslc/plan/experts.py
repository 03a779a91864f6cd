"""Mixture-of-experts layers in the plan: where their experts live and what routing costs.

Per layer, on one device: the expert parameters it holds (their matrices, split over the
expert axes; further split where ZeRO-3 stores them so), the capacity each expert has in a
routing group (a sequence) or, dropless, the rows its experts multiply (the buffer is sized
for the worst case, every choice landing here; the even share beside it), and the bytes of
the layer's own exchange per training step — the all-to-all that sends every expert its
slots and the one that returns the results (capacity-sized buffers [groups, experts, slots,
dim]); dropless, the all-gather of the tokens along the expert axes and the reduce-scatter
of the sums; or, where the tokens are whole along the expert axes, the all-reduce that sums
the experts' outputs — counted forward, backward (the transpose of each) and again wherever
the forward is recomputed (a checkpointed block; the pipeline's rerun of every chunk but the
last; the layer's own recompute inside the pipeline), as `communication` counts them.

How many tokens are actually dropped, the expert load and the auxiliary losses depend on
the router's weights: they are measured when the model runs (`Program.aux`), not planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from dslc.ir.nodes import Axes, Block, Branches, Layer, Layout, Node, Program, Repeat, Residual, Stream, TensorType
from dslc.ir.state import state_sharding
from dslc.layers.moe import MoE, capacity_slots, exchange_collectives, expert_axes, group_tokens, routed_tokens
from dslc.plan.communication import TRANSPOSE, _group_bytes, ring_bytes


@dataclass(frozen=True, slots=True)
class ExpertLayer:
    """One `moe` layer, per device and per training step."""

    path: str
    experts: int
    expert_axes: Axes
    experts_per_device: int
    tokens_per_group: int  # a routing group is one sequence
    slots: int  # per expert and routing group (0: dropless)
    exchange: str  # "all-to-all", "all-gather+reduce-scatter", "all-reduce", or "none" (every expert on every device)
    parameter_bytes: int  # the experts' matrices of one copy, as stored on one device
    exchange_bytes: int  # sent by one device per step for one copy: forward, backward and recompute
    copies: int = 1  # how many times a chunk runs the layer (a repeat's: once per copy)
    # Dropless: the rows one device's experts multiply per routing group, its buffer's
    # (the worst case: every choice it routes lands on its experts) and when routing is even.
    rows_worst: int = 0
    rows_even: int = 0


def experts(program: Program) -> tuple[ExpertLayer, ...]:
    mesh = program.mesh
    staged = program.pipelined
    out = []
    for chunk in program.chunks:
        for layer, checkpointed, copies in _moe_layers(chunk.nodes, False):
            # The checkpointed block's rerun and, inside the pipeline, the layer's own
            # recompute in its backward.
            reruns = int(checkpointed) + int(staged)
            sent, kinds = 0, []
            for c in exchange_collectives(layer):
                size = _group_bytes(c, layer.input, mesh)
                sent += ring_bytes(c.kind, mesh.size(c.axes), size) * (1 + reruns)
                sent += ring_bytes(TRANSPOSE[c.kind], mesh.size(c.axes), size)
                kinds += [c.kind] if c.kind not in kinds else []
            axes = expert_axes(layer, mesh)
            args = MoE().args_of(layer)
            experts_ = args.experts
            matrices = [w.name for w in layer.weights if w.name in ("w_in", "w_gate", "w_out")]
            stored = (state_sharding(layer.weight(n).type, program).params for n in matrices)
            params = sum(
                TensorType(layer.weight(n).type.dtype, layer.weight(n).type.shape, s).local_nbytes(mesh)
                for n, s in zip(matrices, stored, strict=True)
            )
            per_group = group_tokens(layer.input)
            dropless = args.capacity is None
            out.append(
                ExpertLayer(
                    path=layer.path,
                    experts=experts_,
                    expert_axes=axes,
                    experts_per_device=experts_ // mesh.size(axes),
                    tokens_per_group=per_group,
                    slots=capacity_slots(args, per_group),
                    exchange="+".join(kinds) or "none",
                    parameter_bytes=params,
                    exchange_bytes=sent,
                    copies=copies,
                    rows_worst=routed_tokens(layer, mesh, per_group) * args.top_k if dropless else 0,
                    rows_even=routed_tokens(layer, mesh, per_group) * args.top_k // mesh.size(axes) if dropless else 0,
                )
            )
    return tuple(out)


def _moe_layers(nodes: tuple[Node, ...], checkpointed: bool, copies: int = 1) -> list[tuple[Layer, bool, int]]:
    """The `moe` layers among `nodes`, each with whether its forward is recomputed and how
    many times it runs."""
    found = []
    for node in nodes:
        match node:
            case Layer():
                if node.kind == MoE.kind:
                    found.append((node, checkpointed, copies))
            case Layout():
                pass
            case Residual() | Branches() | Stream():
                found += _moe_layers(node.body, checkpointed, copies)
            case Block():
                found += _moe_layers(node.body, checkpointed or node.remat.reruns_block, copies)
            case Repeat():
                found += _moe_layers((node.body,), checkpointed, copies * node.count)
            case _:
                assert_never(node)
    return found
