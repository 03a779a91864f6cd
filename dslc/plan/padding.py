"""What padding a vocabulary costs (`dslc.elaborate.vocabulary`): the planner says so in every plan."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dslc.ir.nodes import Layer, Program, TensorType
from dslc.ir.placement import place
from dslc.layers import args
from dslc.layers.loss import CrossEntropy
from dslc.plan.memory import MOMENTS


@dataclass(frozen=True, slots=True)
class Padding:
    """A stored array the compiler padded: its shape as declared and as stored, the mesh axes
    of the split that needed it, the extra parameters, and the bytes of training state
    (parameters, gradients, optimizer moments) they add on each device."""

    weight: str
    declared: tuple[int, ...]
    stored: tuple[int, ...]
    axes: tuple[str, ...]
    parameters: int
    bytes: int


@dataclass(frozen=True, slots=True)
class LogitsPadding:
    """Logits a padded head widens: their real classes, their width, and the FLOPs per step the
    extra columns cost in the head and the loss (forward and backward)."""

    classes: int
    width: int
    flops: int


def paddings(program: Program) -> tuple[Padding, ...]:
    """Every padded stored array, in model order."""
    out = []
    moments = MOMENTS[program.train.optimizer.name]
    for array in place(program).arrays:
        if not any(array.padding):
            continue
        lead = array.type.rank - len(array.padding)
        declared = array.declared
        state = array.state(program)
        extra = 0
        for sharding, copies in ((state.params, 1), (state.grads, 1), (state.optimizer, moments)):
            padded = TensorType(array.type.dtype, array.type.shape, sharding).local_nbytes(program.mesh)
            unpadded = TensorType(array.type.dtype, declared, sharding).local_nbytes(program.mesh)
            extra += copies * (padded - unpadded)
        # The split that needed it: the weight's own axes, not the stage axis a pipeline adds.
        stage = program.pipeline.axis if program.pipeline is not None else None
        axes = tuple(
            a for i, pad in enumerate(array.padding) if pad for a in array.type.sharding[lead + i] if a != stage
        )
        parameters = array.type.numel - math.prod(declared)
        out.append(Padding(array.name, declared, array.type.shape, axes, parameters, extra))
    return tuple(out)


def logits_padding(program: Program) -> LogitsPadding | None:
    """The loss's padded logits, or None where the loss reads them unpadded."""
    loss = program.loss
    classes = args(loss, CrossEntropy).classes if loss is not None and loss.kind == "cross_entropy" else 0
    if loss is None or not classes:
        return None
    width = loss.input.shape[-1]
    head = program.body[-1] if program.body else None
    forward = loss.flops + (head.flops if isinstance(head, Layer) else 0)
    # The backward pass of a product costs twice its forward.
    return LogitsPadding(classes, width, 3 * forward * (width - classes) // width)
