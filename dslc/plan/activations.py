"""Activation memory per device: what the forward pass keeps for the backward pass.

The model, checkpoint policy by checkpoint policy (see docs/plan.md):

* `checkpoint none` (and code outside any block): every layer keeps what its backward needs
  (each layer rule's `residual_bytes`, dslc/layers: operands of matrix products, f32 copies
  in norms and the loss, attention probabilities [b, heads, s, s] in f32, the embedding's
  one-hot matrix), and the copies of weights cast to the compute dtype.
* `checkpoint full`: a block keeps only its input; its backward recomputes the block, so one
  block's residuals exist again, transiently, while that block's backward runs.
* `checkpoint selective(names)`: the block input plus the outputs of the named layers, with
  the same transient recompute.
* `checkpoint core_attention`: everything `none` keeps but the cores of the block's own
  attention layers (their [b, heads, s, s] scores and probabilities, `core_bytes`), one of
  which exists again, transiently, while its layer's backward runs.

On top of what is kept, the backward pass needs a transient working set: the largest layer's
residual gradients (the rule's `workspace_bytes`), or a recomputed block's whole residuals.
Total activation memory = kept + the largest transient.

Under a pipeline the same model applies to one chunk and one microbatch: the executor
(dslc/runtime/pipeline.py) stashes what a chunk's forward keeps, per microbatch in flight,
and its backward tick needs that chunk's working set (dslc/plan/memory.py counts the slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, assert_never

from dslc.ir.nodes import (
    DTYPE_BYTES,
    Block,
    Branches,
    Layer,
    Layout,
    Mesh,
    Node,
    Repeat,
    Residual,
    Stream,
    TensorType,
    layers,
    own_layers,
)
from dslc.layers import RULES


@dataclass(frozen=True, slots=True)
class Kept:
    """Bytes held until the backward pass reaches them, and the most held at any moment of
    that backward pass (what is kept plus the working set of the node being differentiated)."""

    kept: int = 0
    peak: int = 0


# Where 16-bit values are held in f32 (`cpu_widening` in dslc/plan/memory.py): nowhere; inside
# a repeat's scan (XLA's CPU backend); here, inside one.
Widen = Literal["none", "scans", "all"]


def held_dtype(compute: str, widen: Widen) -> str:
    """The dtype values computed in `compute` are held in: f32 for a 16-bit one when widened."""
    return "f32" if widen == "all" and DTYPE_BYTES[compute] < 4 else compute


def _width(compute: str, recomputed: bool, widen: Widen) -> str:
    """The dtype a layer's residuals and working set are held in: widened inside a scan, and
    wherever a checkpointed block's backward recomputes them when the plan widens at all."""
    return held_dtype(compute, "all" if recomputed and widen != "none" else widen)


def tensor_bytes(t: TensorType, mesh: Mesh, slices: int) -> int:
    return t.slice_numel(mesh, slices) * DTYPE_BYTES[t.dtype]


def _held_bytes(t: TensorType, mesh: Mesh, slices: int, widen: Widen) -> int:
    return t.slice_numel(mesh, slices) * DTYPE_BYTES[held_dtype(t.dtype, widen)]


def weight_copies(layer: Layer, mesh: Mesh, compute: str) -> int:
    """Weights cast to the compute dtype: the backward pass keeps the cast copies."""
    return sum(w.type.local_nbytes(mesh) // DTYPE_BYTES[w.type.dtype] * DTYPE_BYTES[compute] for w in layer.weights)


# Bytes an element of a dropout's random bits on XLA's CPU backend: JAX draws them with
# threefry2x32 from two u32 counters shaped like the mask (`iota_2x32_shape`, its high and low
# words) and lowers threefry on CPU as a rolled loop whose state is two u32 words of that shape
# (elsewhere the loop is unrolled, and XLA fuses it into the mask): four 32-bit words.
RANDOM_BITS_PER_ELEMENT = 16


def random_bits(layer: Layer, mesh: Mesh, slices: int) -> int:
    """The random bits `layer` draws its mask from on XLA's CPU backend, while it makes it: 0
    for a layer that draws none (dropout at rate 0 is the identity)."""
    if not RULES[layer.kind].draws(layer):
        return 0
    return RANDOM_BITS_PER_ELEMENT * layer.output.slice_numel(mesh, slices)


def rerun_random_bits(nodes: tuple[Node, ...], mesh: Mesh, slices: int, rerun: bool = False) -> int:
    """The most random bits one layer draws again in a checkpointed block's backward: a block
    that reruns its forward (`full`, `selective`; its mask is not among what it saves) draws
    its dropouts' masks again there, where `core_attention` and `none` keep them."""
    most = 0
    for node in nodes:
        match node:
            case Layer():
                most = max(most, random_bits(node, mesh, slices) if rerun else 0)
            case Block():
                most = max(most, rerun_random_bits(node.body, mesh, slices, rerun or node.remat.reruns_block))
            case Residual() | Branches() | Stream():
                most = max(most, rerun_random_bits(node.body, mesh, slices, rerun))
            case Repeat():
                most = max(most, rerun_random_bits((node.body,), mesh, slices, rerun))
            case Layout():
                pass
            case _:
                assert_never(node)
    return most


def kept_by(
    nodes: tuple[Node, ...], mesh: Mesh, compute: str, slices: int, recomputed: bool = False, widen: Widen = "none"
) -> Kept:
    """What running `nodes` forward keeps for their backward pass, on one device.

    The backward pass visits the nodes last to first, freeing each node's residuals once it
    is done, so while node i is differentiated the residuals of nodes before it are still
    held: the peak is the largest (kept by nodes before i) + (node i's own peak). A repeat is
    one node here, as it is one `lax.scan` in the lowering. `recomputed`: the nodes run again
    inside a checkpointed block's backward, where XLA fuses elementwise chains into the ops
    that read them (each rule's `recomputed_bytes`). `widen`: where 16-bit values are held
    in f32 instead (`Widen`).
    """
    kept = peak = 0
    for node in nodes:
        one = _kept_by_node(node, mesh, compute, slices, recomputed, widen)
        peak = max(peak, kept + one.peak)
        kept += one.kept
    return Kept(kept, max(peak, kept))


def _kept_by_scan(run: Repeat, mesh: Mesh, compute: str, slices: int, recomputed: bool, widen: Widen) -> Kept:
    """A `lax.scan` over a repeat's layers stacks each step's residuals into one buffer per
    residual, which its backward loop frees only when the loop is done: while the first
    layer is differentiated, every layer's residuals are still held, the first's own
    included. XLA's CPU backend computes 16-bit matrix products in f32 and, converting a
    scan's stacked 16-bit residuals for its backward, does so once for the whole stack before
    the loop: under `widen` "scans" the scan holds them in f32."""
    if widen == "scans" and run.count > 1:
        widen = "all"
    one = _kept_by_node(run.body, mesh, compute, slices, recomputed, widen)
    transient = _transient(run.body, mesh, compute, slices, recomputed, widen)
    return Kept(run.count * one.kept, run.count * one.kept + transient)


def _transient(node: Node, mesh: Mesh, compute: str, slices: int, recomputed: bool, widen: Widen) -> int:
    """What differentiating `node` needs beyond what it kept, when none of what it kept is
    freed before it is done (its residuals sit in a scan's stacked buffers)."""
    match node:
        case Layer():
            return RULES[node.kind].workspace_bytes(node, mesh, _width(compute, recomputed, widen), slices)
        case Block() if node.remat.reruns_block:
            # The body is recomputed as a whole, into the step's own temporaries.
            one = _kept_by_node(node, mesh, compute, slices, recomputed, widen)
            return one.peak - one.kept
        case Block() if node.remat.policy == "core_attention":
            # Its own layers' working sets, one of them a layer's recomputed core besides.
            return max((_transient(c, mesh, compute, slices, recomputed, widen) for c in node.body), default=0) + max(
                _cores(node, mesh, compute, slices, widen), default=0
            )
        case Block() | Residual() | Branches() | Stream():
            return max((_transient(c, mesh, compute, slices, recomputed, widen) for c in node.body), default=0)
        case Repeat():
            return _transient(node.body, mesh, compute, slices, recomputed, widen)
        case Layout():
            return 0
        case _:
            assert_never(node)


def _kept_by_node(
    node: Node, mesh: Mesh, compute: str, slices: int, recomputed: bool = False, widen: Widen = "none"
) -> Kept:
    match node:
        case Layer():
            rule = RULES[node.kind]
            cast = any(w.type.dtype != compute for w in node.weights)
            # Widened, what it keeps is held in f32 — and what a checkpointed block's backward
            # recomputes, wherever it runs: XLA's CPU backend converts the 16-bit operands of
            # the recomputed matrix products to f32 once for both the forward and the backward
            # product. Its working set, the gradients of what it keeps, is made in f32 as well.
            width = _width(compute, recomputed, widen)
            copies = weight_copies(node, mesh, width) if cast else 0
            residuals = rule.recomputed_bytes if recomputed else rule.residual_bytes
            kept = residuals(node, mesh, width, slices) + copies
            return Kept(kept, kept + rule.workspace_bytes(node, mesh, width, slices))
        case Residual() | Branches():
            return kept_by(node.body, mesh, compute, slices, recomputed, widen)
        case Stream():
            # What the stream computes is held for the layers that read it, and for their
            # backward passes, once however many read it.
            inner = kept_by(node.body, mesh, compute, slices, recomputed, widen)
            held = _held_bytes(node.result, mesh, slices, widen)
            return Kept(inner.kept + held, inner.peak + held)
        case Repeat():
            return _kept_by_scan(node, mesh, compute, slices, recomputed, widen)
        case Layout():
            return Kept()
        case Block():
            # A checkpointed block's backward runs it again: what that materialises is the
            # working set.
            inner = kept_by(node.body, mesh, compute, slices, recomputed or node.remat.reruns_block, widen)
            match node.remat.policy:
                case "none":
                    return inner
                case "full":
                    held = _held_bytes(node.input, mesh, slices, widen)
                    return Kept(held, held + inner.peak)
                case "selective":
                    held = _held_bytes(node.input, mesh, slices, widen) + sum(
                        _held_bytes(layer.output, mesh, slices, widen)
                        for layer in layers(node.body)
                        if layer.path in node.remat.saved
                    )
                    reruns = _reruns(node)
                    rerun = max((kept_by(run, mesh, compute, slices, True, widen).peak for run in reruns), default=0)
                    return Kept(held, held + rerun)
                case "core_attention":
                    return without_cores(node, inner, mesh, compute, slices, widen)
                case other:
                    assert_never(other)
        case _:
            assert_never(node)


def _reruns(block: Block) -> list[tuple[Node, ...]]:
    """The runs of a `selective` block's body that its backward recomputes one after another:
    the body cut after each saved layer. A run reads only the block input and the saved
    outputs, so the backward (last run first) recomputes a run when it reaches it and frees
    its residuals when done; XLA schedules them so, and no two runs' residuals coexist."""
    runs: list[list[Node]] = [[]]
    stack = list(reversed(block.body))
    while stack:
        node = stack.pop()
        if isinstance(node, Residual | Branches | Stream):
            stack.extend(reversed(node.body))
            continue
        runs[-1].append(node)
        if isinstance(node, Layer) and node.path in block.remat.saved:
            runs.append([])
    return [tuple(run) for run in runs if run]


def _cores(block: Block, mesh: Mesh, compute: str, slices: int, widen: Widen) -> list[int]:
    width = held_dtype(compute, widen)  # as the block would keep them: taken off its kept bytes
    return [RULES[layer.kind].core_bytes(layer, mesh, width, slices) for layer in own_layers(block.body)]


def without_cores(block: Block, inner: Kept, mesh: Mesh, compute: str, slices: int, widen: Widen = "none") -> Kept:
    """`checkpoint core_attention`: what the block keeps less its own attention layers' cores
    (the scores and probabilities [b, heads, s, s]); the backward pass recomputes one core at
    a time, next to what is kept."""
    cores = _cores(block, mesh, compute, slices, widen)
    kept = inner.kept - sum(cores)
    return Kept(kept, max(kept, inner.peak - sum(cores) + max(cores, default=0)))
