"""Bytes per device, by what they hold: the training state and the activations.

Training state is counted array by array as the module stores it (`dslc.ir.placement`),
split by ZeRO / FSDP as `dslc.ir.state` says — the generated module reads both:

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

import math
from dataclasses import dataclass

from dslc.ir.data_parallel import data_parallel_axes
from dslc.ir.nodes import DTYPE_BYTES, Mesh, Node, Program, Repeat, TensorType
from dslc.ir.placement import Placement, place
from dslc.ir.schedule import microbatch_slices, pipeline_figures
from dslc.ir.state import gathered_weights_kept
from dslc.plan.activations import Kept, kept_by, rerun_random_bits, tensor_bytes

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
    update: int = 0  # what the optimizer update holds beyond the gradient step's temporaries
    # Gradients the training step writes into donated parameters' buffers (`cpu_widening`).
    reused: int = 0
    # Dropout's random bits, which the training step alone draws, made again by a recompute
    # (`cpu_random_bits`).
    random_bits: int = 0

    @property
    def grads_step(self) -> int:
        return self.params + self.grads + self.grad_accumulator + self.inputs + self.activations + self.temporaries

    @property
    def total(self) -> int:
        return self.grads_step + self.optimizer + self.update + self.random_bits - self.reused


@dataclass(frozen=True, slots=True)
class State:
    """The training state on one device: what a step holds whatever the batch."""

    params: int
    grads: int
    optimizer: int
    accumulators: int
    gathered: int  # whole copies of the weights split over the stage axis, for the step
    held: int  # the gradients the step computes: the stage's own pieces, gathered arrays whole
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


def gradient_type(t: TensorType, program: Program) -> TensorType:
    """A stored array's gradient, and what sums it: in `grad_dtype` where the spec widens it."""
    return TensorType(program.train.grad_dtype or t.dtype, t.shape, t.sharding)


def training_state(program: Program, placement: Placement | None = None) -> State:
    """Parameters, gradients, optimizer state and accumulators per device, as stored."""
    mesh, train = program.mesh, program.train
    axis = program.pipeline.axis if program.pipelined and program.pipeline else None
    params = grads = optimizer = held = gathered = returned = 0
    for array in (placement or place(program)).arrays:
        state = array.state(program)
        params += _local(array.type, state.params, mesh)
        gradient = gradient_type(array.type, program)
        grad = _local(gradient, state.grads, mesh)
        grads += grad
        optimizer += optimizer_state_bytes(array.type, state.optimizer, program)
        # What the step computes the gradient in: the stage's own piece, or a gathered whole.
        whole = tuple(tuple(a for a in axes if a != axis) for axes in array.type.sharding)
        computed = whole if array.split_dim is not None else array.type.sharding
        here = _local(gradient, computed, mesh)
        held += here
        if array.split_dim is not None:
            gathered += _local(array.type, computed, mesh)
        elif array.stage_dim is not None and grad == here:
            # The executor returns a stage's own piece of the accumulator as it is: the
            # accumulator's buffer is the gradient the step returns.
            returned += here
    details = []
    accumulators = 0
    if train.accumulate > 1:
        accumulators += held
        details.append((f"gradient accumulator (accumulate {train.accumulate})", held))
    if axis is not None and held > returned:
        accumulators += held - returned
        details.append(("pipeline gradient accumulator (gathered or replicated arrays)", held - returned))
    if gathered:
        details.append(("weights split over the stage axis, gathered for the step", gathered))
    return State(params, grads, optimizer, accumulators, gathered, held, tuple(details))


def memory(program: Program, backend: str | None = None) -> Memory:
    """Bytes per device of one training step. `backend`: the XLA backend the step is compiled
    for, when known (`dslc plan --xla`, the accuracy table): on "cpu" the temporaries add what
    that backend alone holds (`cpu_widening`); None plans for an accelerator."""
    mesh, train = program.mesh, program.train
    placement = place(program)
    state = training_state(program, placement)
    inputs = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details = list(state.details)
    temporaries = state.gathered
    # XLA's CPU backend's f32 copies live from before a scan's forward loop to the end of its
    # backward loop: beside the loops' own temporaries, not the step's end.
    widened, reused, widen_details = cpu_widening(program, placement) if backend == "cpu" else (0, 0, [])
    if program.pipelined:
        acts, pipe_details, pipe_temps = pipeline_activations(program, state, placement)
        details.extend(pipe_details + widen_details)
        temporaries += pipe_temps + widened
    else:
        kept = kept_by(program.nodes, mesh, train.compute_dtype, microbatch_slices(program))
        gathered = gathered_weights_kept(program)
        acts = kept.peak + gathered
        details.append(("activations kept for the backward pass", kept.kept))
        if gathered:
            details.append(
                ("layers' gathered weights, kept for the backward pass (no checkpoint reruns them)", gathered)
            )
        details.append(
            ("backward working set at its peak (a layer's gradients, a recomputed block)", kept.peak - kept.kept)
        )
        scans, scan_details = scan_temporaries(program, placement)
        summed, sum_details = summed_by_hand(program, placement)
        temporaries += max(scans + widened, summed)
        details.extend(scan_details + widen_details + sum_details)
        if backend == "cpu":
            # The sum comes after the backward pass, whose activations and loops' temporaries
            # are dead by then: it holds more only where it is larger than they are.
            twice = cpu_summed_twice(program, placement)
            beyond = max(0, twice - acts - temporaries)
            temporaries += beyond
            details.append(
                (
                    "XLA's CPU backend: the gradients of weights outside a scan summed over the data axes, "
                    "held twice at the sum, beyond the backward's buffers",
                    beyond,
                )
            )
    # The update writes each array's new value (under ZeRO 1 and 2 gathered whole again)
    # before it lands in the donated buffer: the largest of them, where the step's own
    # temporaries and activations, all dead by then, are not larger.
    new = max((_local(a.type, a.state(program).params, mesh) for a in placement.arrays), default=0)
    update = max(0, new - temporaries - acts)
    details.append(("the optimizer update: the largest array's new value, beyond the temporaries", update))
    bits = cpu_random_bits(program) if backend == "cpu" else 0
    if backend == "cpu":
        details.append(("XLA's CPU backend: gradients in the widened parameters' donated buffers (less)", reused))
        details.append(
            ("XLA's CPU backend: dropout's random bits, drawn again where a recompute reruns it (training step)", bits)
        )
    return Memory(
        state.params,
        state.grads,
        state.accumulators,
        state.optimizer,
        inputs,
        acts,
        temporaries,
        tuple(details),
        update,
        reused,
        bits,
    )


def scan_temporaries(program: Program, placement: Placement) -> tuple[int, list[tuple[str, int]]]:
    """What a repeat's `lax.scan` holds besides its activations, in the largest of the step's
    repeats (they run one after another). A forward step slices one layer's weights out of
    the stack; where ZeRO 3 or FSDP stores them split over the data axes it gathers them
    instead, and XLA's layout assignment puts the gathered dimension outermost: it copies the
    device's stacked pieces into that layout once before the loop and the gathered matrix
    back into the layer's own. A backward step makes one layer's weight gradients and, unless
    the step sums gradients by hand once at its end (`data_parallel_axes`), their sum over
    the data axes into a second buffer, before writing it into the stacked gradient."""
    mesh = program.mesh
    repeats: dict[str, list[tuple[int, int, int]]] = {}
    for array in placement.arrays:
        if not array.layers or "*" not in array.name:
            continue
        layers = math.prod(array.type.shape[: array.lead])
        one = array.type.local_nbytes(mesh) // layers  # one layer's weights as the layer computes
        stored = _local(array.type, array.state(program).params, mesh)
        gathered = stored < array.type.local_nbytes(mesh)
        repeats.setdefault(array.name.split("*")[0], []).append((one, stored if gathered else 0, layers))
    by_hand = bool(data_parallel_axes(program))
    best, details = 0, []
    for prefix, arrays in repeats.items():
        if max(layers for _, _, layers in arrays) < 2:
            continue
        layer = sum(one for one, _, _ in arrays)
        relaid = sum(stored for _, stored, _ in arrays)
        forward = layer + relaid + (max(one for one, _, _ in arrays) if relaid else 0)
        backward = layer if by_hand else 2 * layer
        if max(forward, backward) > best:
            best = max(forward, backward)
            details = [
                (
                    f"scan `{prefix[:-1]}`: a forward step's layer weights"
                    + (", gathered and relaid" if relaid else ""),
                    forward,
                ),
                (
                    f"scan `{prefix[:-1]}`: a backward step's layer gradients"
                    + ("" if by_hand else " and their sum over the data axes"),
                    backward,
                ),
            ]
    return best, details


def cpu_widening(program: Program, placement: Placement) -> tuple[int, int, list[tuple[str, int]]]:
    """What XLA's CPU backend holds beyond the plan of a 16-bit step: it computes 16-bit
    matrix products in f32, converting their operands, and where the operand is sliced out of
    a scan's stacked array (a repeat's weights, its saved residuals) it converts the whole
    stack once, before the loop. At the step's peak it then holds an f32 copy of every 16-bit
    stacked weight besides the weight itself (and one layer's f32 slice of it, which a loop
    step computes with), and a scan's 16-bit residuals in f32 instead (under a pipeline,
    those of the one slot a backward tick reads). An accelerator computes in 16 bits and
    holds none of it.

    Returns (those bytes, the bytes the training step saves, details). Without a pipeline the
    16-bit stacked weights are dead once copied, and the training step, which donates them,
    makes their stacked gradients in their buffers (a pipeline reads them on every tick)."""
    mesh, compute = program.mesh, program.train.compute_dtype
    weights = reused = 0
    for array in placement.arrays:
        layers = math.prod(array.type.shape[: array.lead])
        if array.layers and "*" in array.name and layers > 1 and DTYPE_BYTES[array.type.dtype] < 4:
            wide = array.type.local_nbytes(mesh) * 4 // DTYPE_BYTES[array.type.dtype]
            weights += wide + wide // layers  # the stack's copy, and a step's layer sliced out of it
            state = array.state(program)
            reused += min(_local(array.type, state.params, mesh), _local(array.type, state.grads, mesh))
    slices = microbatch_slices(program)
    if program.pipelined:
        pairs = [
            (kept_by(c.nodes, mesh, compute, slices), kept_by(c.nodes, mesh, compute, slices, widen="scans"))
            for c in program.chunks
        ]
        residuals = max((wide.peak - narrow.peak for narrow, wide in pairs), default=0)
    else:
        narrow = kept_by(program.nodes, mesh, compute, slices)
        residuals = kept_by(program.nodes, mesh, compute, slices, widen="scans").peak - narrow.peak
    return (
        weights + residuals,
        0 if program.pipelined else reused,
        [
            ("XLA's CPU backend: an f32 copy of each scan's 16-bit stacked weights, and of one layer's", weights),
            ("XLA's CPU backend: a scan's 16-bit residuals held in f32", residuals),
        ],
    )


def cpu_random_bits(program: Program) -> int:
    """What the training step holds at its peak on XLA's CPU backend beyond the gradient step:
    the random bits of the dropouts a checkpointed block's backward reruns, drawn again inside
    the recompute (`activations.rerun_random_bits`: four 32-bit words an element of the mask,
    its two counters and the two words of threefry's rolled loop), the largest one's. The
    gradient step runs without dropout and draws none; on an accelerator JAX unrolls threefry
    and XLA fuses it into the mask. Under a pipeline, one microbatch's in a chunk's backward
    tick; without one, the whole batch slice's."""
    slices = microbatch_slices(program)
    groups = [c.nodes for c in program.chunks] if program.pipelined else [program.nodes]
    return max((rerun_random_bits(g, program.mesh, slices) for g in groups), default=0)


def cpu_summed_twice(program: Program, placement: Placement) -> int:
    """The gradients XLA's CPU backend holds twice where it sums them over the data axes: the
    gradients of the weights outside a scan (a repeat's stacked weights are summed step by
    step inside its backward loop, `scan_temporaries`), in a step that leaves the sum to XLA
    (no pipeline, nothing summed by hand: `data_parallel_axes`), whose stored gradient is the
    whole sum (not split by ZeRO over those axes). XLA's all-reduce combiner merges their
    all-reduces into one tuple all-reduce, which runs once the backward pass has made the
    last of them, and the CPU backend writes an all-reduce's sums into new buffers beside its
    inputs (a GPU's NCCL all-reduce runs in place): the unsummed gradients, in the buffers
    the step returns, and their sums, copied into those buffers afterwards, coexist."""
    if program.pipelined or data_parallel_axes(program) or not program.inputs:
        return 0
    mesh = program.mesh
    data = tuple(a for a in program.input(program.stream).type.sharding[0] if mesh.size((a,)) > 1)
    held = 0
    for array in placement.arrays:
        if array.layers and "*" in array.name and math.prod(array.type.shape[: array.lead]) > 1:
            continue  # a scan's stacked weights
        if not any(a not in array.type.axes_used for a in data):
            continue  # split over every data axis: nothing to sum
        gradient = gradient_type(array.type, program)
        whole = gradient.local_nbytes(mesh)
        if _local(gradient, array.state(program).grads, mesh) == whole:
            held += whole
    return held


def summed_by_hand(program: Program, placement: Placement) -> tuple[int, list[tuple[str, int]]]:
    """A step that sums its gradients by hand once at its end (`data_parallel_axes`) scales
    each device's unsummed gradient into a new buffer and reduce-scatters it into the piece
    the optimizer updates: the largest array's both at once."""
    if not data_parallel_axes(program):
        return 0, []
    mesh = program.mesh
    largest = max(
        (
            _local(gradient_type(a.type, program), a.state(program).grads, mesh)
            + _local(a.type, a.state(program).optimizer, mesh)
            for a in placement.arrays
        ),
        default=0,
    )
    return largest, [("the gradients summed at the step's end: the largest array's and its piece", largest)]


def pipeline_activations(
    program: Program, state: State | None = None, placement: Placement | None = None
) -> tuple[int, list[tuple[str, int]], int]:
    """The executor's buffers on a stage, as (activations, details, temporaries). Activations:
    per stash slot one chunk input and one microbatch's residuals, receive slots for
    activations and gradients (each buffer with one scratch slot besides the table's), the
    slot a backward tick reads, and one chunk's backward working set. Temporaries, which no
    schedule changes: the batch split into microbatches, and the weight gradients a backward
    tick returns."""
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
    # The backward reads one slot out of the stash (the residuals and the chunk input) and
    # its output gradient out of the receive buffer; the forward's new slot is written into
    # the stash before the backward runs.
    tick = residuals + 2 * boundary
    # The backward switch returns a gradient for every array of the stage (zeros for those
    # its chunk does not read), which is then added to the accumulator.
    placement = placement or place(program)
    returned = (state or training_state(program, placement)).held
    # With one row of a microbatch on a device, XLA lays the stash's stacked residuals out
    # with that unit dimension elsewhere than the backward's scan reads them, and copies the
    # slot's scanned residuals into the scan's layout for every backward.
    rows = min((t.local_shape(mesh)[0] for t in program.boundaries if t.rank), default=0)
    scanned = max((_scanned(c.nodes, mesh, train.compute_dtype, slices) for c in program.chunks), default=0)
    relaid = scanned if -(-rows // pipeline.microbatches) == 1 else 0
    unpadded = max(
        (max(_part_gradients(program, placement, c), default=0) for c in range(len(program.chunks))), default=0
    )
    details = [
        (
            f"stash: {slots.stash_slots} slots of a chunk's input and residuals "
            f"({pipeline.schedule}, {pipeline.microbatches} microbatches)",
            stash,
        ),
        (f"receive buffers: {slots.activation_slots} activation + {slots.gradient_slots} gradient slots", received),
        ("a backward tick's slot read from the stash, and its output gradient", tick),
        ("one chunk's backward working set for one microbatch", working),
        ("the weight gradients a backward tick returns, one per array of the stage", returned),
        ("a chunk's weight gradient before it is padded into its array", unpadded),
        ("the slot's scanned residuals copied into the scan's layout (one row per microbatch)", relaid),
    ]
    # The executor reshapes the batch into microbatches: one copy of the inputs.
    copy = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details.append(("the batch split into microbatches (a copy)", copy))
    return stash + received + tick + working + relaid, details, copy + returned + unpadded


def _scanned(nodes: tuple[Node, ...], mesh: Mesh, compute: str, slices: int) -> int:
    """What the scans of a chunk's repeats (of more than one block) keep, stacked."""
    return sum(kept_by((n,), mesh, compute, slices).kept for n in nodes if isinstance(n, Repeat) and n.count > 1)


def _part_gradients(program: Program, placement: Placement, chunk: int) -> list[int]:
    """Bytes of the weight gradients chunk `chunk` computes for a part of its stage's piece of
    an array (a row padded to a larger one, one of a stage's virtual chunks): each is made at
    its own shape and then padded into a gradient of the whole piece, so both exist at once.
    A chunk that reads the whole piece makes that gradient directly."""
    stages = program.stages
    sizes = []
    for share in placement.shares[chunk].values():
        array = placement.array(share.stored)
        piece = math.prod(array.type.shape) // (stages if array.stage_dim is not None else 1)
        part = math.prod(share.shape)
        if part < piece:
            sizes.append(array.type.local_nbytes(program.mesh) * part // piece)
    return sizes


__all__ = ["Kept", "Memory", "State", "memory", "optimizer_state_bytes", "pipeline_activations", "training_state"]
