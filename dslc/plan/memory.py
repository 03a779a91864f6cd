"""Bytes per device, by what they hold: the training state and the activations.

Training state follows `dslc.ir.state` (ZeRO / FSDP), which the backend also uses. It is
counted the way the lowering keeps it today:

* every device holds the weights of *every* pipeline stage (the executor replicates
  parameters over the stage axis), and a pipelined step keeps a full-size gradient
  accumulator per device besides the gradients it returns;
* `accumulate N` adds one accumulator of the gradients' size;
* a `repeat` runs as one `lax.scan` over stacked weights: the stacked copy of its weights and
  of their gradients are temporaries of the step;
* optimizer state is what optax keeps: adam and adamw two moments shaped like each
  parameter, sgd (with momentum) one, in the parameter dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.ir.nodes import Mesh, Node, Program, TensorType, Weight, weights_by_path
from dslc.ir.state import state_sharding
from dslc.plan.activations import Kept, kept_by, scan_runs, tensor_bytes
from dslc.plan.timetable import microbatch_slices, pipeline_figures, pipelined

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


def _local(t: TensorType, sharding: tuple[tuple[str, ...], ...], mesh: Mesh) -> int:
    return TensorType(t.dtype, t.shape, sharding).local_nbytes(mesh)


def memory(program: Program) -> Memory:
    mesh, train = program.mesh, program.train
    weights = weights_by_path(program)
    state = {path: state_sharding(w.type, program) for path, w in weights.items()}
    params = sum(_local(w.type, state[p].params, mesh) for p, w in weights.items())
    grads = sum(_local(w.type, state[p].grads, mesh) for p, w in weights.items())
    optimizer = MOMENTS[train.optimizer.name] * sum(
        _local(w.type, state[p].optimizer, mesh) for p, w in weights.items()
    )
    inputs = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details: list[tuple[str, int]] = []

    # Gradients as the model computes them, before ZeRO-2 splits them: the declared sharding.
    full_grads = sum(w.type.local_nbytes(mesh) for w in weights.values())
    accumulator = full_grads if train.accumulate > 1 else 0
    if accumulator:
        details.append((f"gradient accumulator (accumulate {train.accumulate})", accumulator))

    staged = pipelined(program)
    # Scans run one chunk at a time; under a pipeline only one chunk's are alive at once.
    per_chunk = [_scan_temporaries(chunk.nodes, weights, mesh, train.compute_dtype) for chunk in program.chunks]
    worst = max(per_chunk, key=lambda d: sum(b for _, b in d), default=[])
    for chunk_details in [worst] if staged else per_chunk:
        details.extend(chunk_details)
    temporaries = sum(b for d in ([worst] if staged else per_chunk) for _, b in d)

    if staged:
        acts, pipe_details, pipe_temps = _pipeline_activations(program)
        accumulator += full_grads
        details.append(("pipeline gradient accumulator (full size, every stage)", full_grads))
        details.extend(pipe_details)
        temporaries += pipe_temps
    else:
        slices = microbatch_slices(program)
        kept = kept_by(tuple(n for chunk in program.chunks for n in chunk.nodes), mesh, train.compute_dtype, slices)
        acts = kept.peak
        details.append(("activations kept for the backward pass", kept.kept))
        details.append(
            ("backward working set at its peak (a layer's gradients, a recomputed block)", kept.peak - kept.kept)
        )
    return Memory(params, grads, accumulator, optimizer, inputs, acts, temporaries, tuple(details))


def _scan_temporaries(
    nodes: tuple[Node, ...], weights: dict[str, Weight], mesh: Mesh, compute: str
) -> list[tuple[str, int]]:
    """A scan over a `repeat` stacks its weights (one copy) and their gradients (another);
    without checkpointing it also keeps each step's weights for the backward pass."""
    out = []
    for run in scan_runs(nodes):
        ws = [w for path, w in weights.items() if any(path.startswith(b.path + ".") for b in run)]
        size = sum(w.type.local_nbytes(mesh) for w in ws)
        name = f"`{run[0].path}` .. `{run[-1].path}`"
        out.append((f"stacked weights and gradients of {name} (lax.scan)", 2 * size))
    return out


def _pipeline_activations(program: Program) -> tuple[int, list[tuple[str, int]], int]:
    """Stash, receive buffers and one chunk's backward, as the pipeline executor lays them out."""
    pipeline = program.pipeline
    assert pipeline is not None
    mesh, train = program.mesh, program.train
    M = pipeline.microbatches
    slices = microbatch_slices(program)
    slots = pipeline_figures(program)
    assert slots is not None
    outs = [chunk.nodes[-1].output for chunk in program.chunks[:-1] if chunk.nodes]
    boundary = max((tensor_bytes(t, mesh, slices) for t in outs), default=0)
    stream = tensor_bytes(program.input(program.stream).type, mesh, slices)
    stash = slots.stash_slots * (boundary + stream)
    received = (slots.activation_slots + slots.gradient_slots) * boundary
    chunk = max(
        (kept_by(c.nodes, mesh, train.compute_dtype, slices) for c in program.chunks),
        key=lambda k: k.peak,
        default=Kept(),
    )
    details = [
        (f"stash: {slots.stash_slots} slots of chunk inputs ({pipeline.schedule}, {M} microbatches)", stash),
        (f"receive buffers: {slots.activation_slots} activation + {slots.gradient_slots} gradient slots", received),
        ("one chunk's forward + backward for one microbatch (recomputed from the stash)", chunk.peak),
    ]
    # The executor reshapes the batch into microbatches: one copy of the inputs.
    copy = sum(inp.type.local_nbytes(mesh) for inp in program.inputs)
    details.append(("the batch split into microbatches (a copy)", copy))
    return stash + received + chunk.peak, details, copy
