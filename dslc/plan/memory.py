"""Bytes per device, by what they hold: the training state and the activations.

Training state is counted array by array as the module stores it (`dslc.ir.placement`),
split by ZeRO / FSDP as `dslc.ir.state` says — the backend reads both:

* a repeat's weights are one stacked array each; under a pipeline each stage holds only its
  own stage's layers (or rows), and a weight outside the stages' region (an embedding, a head)
  is split over the stage axis between steps and gathered, whole, for the step;
* the pipelined step keeps a gradient accumulator of the stage's own arrays (whole for a
  gathered one) besides the gradients it returns; `accumulate N` adds one accumulator of the
  gradients' size;
* optimizer state is what optax keeps: adam and adamw two moments shaped like each
  parameter, sgd (with momentum) one, in the parameter dtype; with a master copy of 16-bit
  parameters (`master_dtype f32`), the master and the moments in f32.

Activations follow `dslc.plan.activations`: without a pipeline, what the whole forward keeps
for its backward; under one, what each microbatch's chunk forward keeps (its residuals, which
the spec's checkpointing decides), in as many stash slots as the schedule's buffer plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.ir.nodes import Mesh, Program, TensorType
from dslc.ir.placement import place
from dslc.plan.activations import Kept, kept_by, tensor_bytes
from dslc.plan.timetable import microbatch_slices, pipeline_figures

MOMENTS = {"adamw": 2, "adam": 2, "sgd": 1}


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes on one device. `grads_step` is the gradient computation alone (what `Program.grads`
    compiles); `total` is the whole training step, optimizer state included."""

    params: int
    grads: int
    grad_accumulator: int
    optimizer: int
    inputs: int
    activations: int
    temporaries: int
    details: tuple[tuple[str, int], ...]

    @property
    def grads_step(self) -> int:
        return self.params + self.grads + self.grad_accumulator + self.inputs + self.activations + self.temporaries

    @property
    def total(self) -> int:
        return self.grads_step + self.optimizer


@dataclass(frozen=True, slots=True)
class State:
    """The training state on one device: what a step holds whatever the batch."""

    params: int
    grads: int
    optimizer: int
    accumulators: int
    gathered: int  # whole copies of the weights split over the stage axis, for the step
    details: tuple[tuple[str, int], ...]


def _local(t: TensorType, sharding: tuple[tuple[str, ...], ...], mesh: Mesh) -> int:
    return TensorType(t.dtype, t.shape, sharding).local_nbytes(mesh)


def optimizer_state_bytes(t: TensorType, sharding: tuple[tuple[str, ...], ...], program: Program) -> int:
    """One stored array's optimizer state on one device, split as `sharding` says: optax's
    moments in the parameters' dtype, or, with a master copy (`master_dtype`), the master and
    the moments in its dtype — for Adam the 4 + 8 bytes per parameter of ZeRO's 12."""
    train = program.train
    copies = MOMENTS[train.optimizer.name]
    if train.master_dtype is not None:
        t, copies = TensorType(train.master_dtype, t.shape, t.sharding), copies + 1
    return copies * _local(t, sharding, program.mesh)


def training_state(program: Program) -> State:
    """Parameters, gradients, optimizer state and accumulators per device, as stored."""
    mesh, train = program.mesh, program.train
    axis = program.pipeline.axis if program.pipelined and program.pipeline else None
    params = grads = optimizer = held = gathered = 0
    for array in place(program).arrays:
        state = array.state(program)
        params += _local(array.type, state.params, mesh)
        grads += _local(array.type, state.grads, mesh)
        optimizer += optimizer_state_bytes(array.type, state.optimizer, program)
        # What the step computes the gradient in: the stage's own piece, or a gathered whole.
        whole = tuple(tuple(a for a in axes if a != axis) for axes in array.type.sharding)
        here = _local(array.type, whole if array.split_dim is not None else array.type.sharding, mesh)
        held += here
        if array.split_dim is not None:
            gathered += here
    details = []
    accumulators = 0
    if train.accumulate > 1:
        accumulators += held
        details.append((f"gradient accumulator (accumulate {train.accumulate})", held))
    if axis is not None:
        accumulators += held
        details.append(("pipeline gradient accumulator (this stage's arrays)", held))
    if gathered:
        details.append(("weights split over the stage axis, gathered for the step", gathered))
    return State(params, grads, optimizer, accumulators, gathered, tuple(details))


def memory(program: Program) -> Memory:
    mesh, train = program.mesh, program.train
    state = training_state(program)
    inputs = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details = list(state.details)
    temporaries = state.gathered
    if program.pipelined:
        acts, pipe_details, pipe_temps = pipeline_activations(program)
        details.extend(pipe_details)
        temporaries += pipe_temps
    else:
        kept = kept_by(program.nodes, mesh, train.compute_dtype, microbatch_slices(program))
        acts = kept.peak
        details.append(("activations kept for the backward pass", kept.kept))
        details.append(
            ("backward working set at its peak (a layer's gradients, a recomputed block)", kept.peak - kept.kept)
        )
    return Memory(
        state.params, state.grads, state.accumulators, state.optimizer, inputs, acts, temporaries, tuple(details)
    )


def pipeline_activations(program: Program) -> tuple[int, list[tuple[str, int]], int]:
    """The executor's buffers on a stage: per stash slot one chunk input and one microbatch's
    residuals, receive slots for activations and gradients (each buffer with one scratch slot
    besides the table's), and one chunk's backward working set."""
    pipeline = program.pipeline
    assert pipeline is not None
    mesh, train = program.mesh, program.train
    slices = microbatch_slices(program)
    slots = pipeline_figures(program)
    assert slots is not None
    boundary = max((tensor_bytes(t, mesh, slices) for t in program.boundaries), default=0)
    # All stages run one program, so every stage's stash can hold any chunk's residuals.
    chunks = [kept_by(c.nodes, mesh, train.compute_dtype, slices) for c in program.chunks]
    residuals = max((k.kept for k in chunks), default=0)
    working = max((k.peak - k.kept for k in chunks), default=0)
    stash = (slots.stash_slots + 1) * (boundary + residuals)
    received = (slots.activation_slots + slots.gradient_slots + 2) * boundary
    # A tick's own values: the residuals its forward makes and those its backward reads (one
    # slot's worth each, outside the stash), and the chunk's weight gradients it adds up.
    tick = 2 * (boundary + residuals)
    details = [
        (
            f"stash: {slots.stash_slots} slots of a chunk's input and residuals "
            f"({pipeline.schedule}, {pipeline.microbatches} microbatches)",
            stash,
        ),
        (f"receive buffers: {slots.activation_slots} activation + {slots.gradient_slots} gradient slots", received),
        ("a tick's residuals, made by its forward and read by its backward", tick),
        ("one chunk's backward working set for one microbatch", working),
    ]
    # The executor reshapes the batch into microbatches: one copy of the inputs.
    copy = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details.append(("the batch split into microbatches (a copy)", copy))
    return stash + received + tick + working, details, copy


__all__ = ["Kept", "Memory", "State", "memory", "optimizer_state_bytes", "pipeline_activations", "training_state"]
