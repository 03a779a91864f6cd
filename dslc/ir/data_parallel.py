"""Which mesh axes a training step runs data-parallel by hand, summing gradients once per step.

A step that cuts its batch into slices (pipeline microbatches, accumulation steps) would, left
to XLA's partitioner, all-reduce every slice's gradients over the batch's axes as each slice
makes them. Along the axes named here, each device instead works through its own rows for
the whole step and the gradients are summed once, at its end (`kernels.training.data_parallel`),
each reduce-scattered to the piece the device updates where ZeRO splits the optimizer state
over those axes. ZeRO 1 runs this way even in one slice: left to the partitioner, which has no
gradient split to aim at, its gradients would be all-reduced whole and then sliced.
Pure data, no jax: the code generator and the planner ask the same function.
"""

from __future__ import annotations

from dslc.ir.nodes import Axes, Program
from dslc.ir.placement import place


def data_parallel_axes(program: Program) -> Axes:
    """The axes along which each device works through its own rows of the batch for the
    whole step, its gradients summed over them once; empty when the step is one slice (no
    pipeline, no accumulation), whose gradients are summed once anyway — unless ZeRO 1 splits
    the optimizer state, whose pieces the sum reduce-scatters into, or the gradients are summed
    wider than the parameters (`grad_dtype`), which XLA's own sum, made where the backward pass
    makes each gradient, would not be.

    They are the leading axes that split every input's first (batch) dimension — a device's
    rows must be one block of the batch — of more than one device, up to the first that
    also splits a parameter between steps: ZeRO-3 and FSDP gather parameters layer by layer
    and hand each slice's gradients straight back, reduce-scattered, so that no device ever
    holds a whole gradient; a mixture of experts' weights split over an axis exchange the
    tokens along it."""
    train = program.train
    by_hand = program.pipelined or train.accumulate > 1 or train.zero == 1 or train.grad_dtype is not None
    if not by_hand or not program.inputs:
        return ()
    mesh = program.mesh
    batch = [tuple(a for a in i.type.sharding[0] if mesh.size((a,)) > 1) for i in program.inputs if i.type.rank]
    if len(batch) != len(program.inputs):
        return ()
    splitting = {a for array in place(program).arrays for axes in array.state(program).params for a in axes}
    axes: list[str] = []
    for a in batch[0]:
        if a in splitting or any(len(b) <= len(axes) or b[len(axes)] != a for b in batch):
            break
        axes.append(a)
    return tuple(axes)
