"""What reverse-mode autodiff keeps from each layer's forward pass, per device.

This is the planner's model of the activation memory of one layer, in bytes, for the slice of
the batch one forward call sees on one device. It follows what `jax.vjp` saves for each
layer's `apply` (dslc/layers): a matrix product keeps its operand (for the weight gradient),
a nonlinearity keeps its input and its own intermediate, a softmax keeps its output.
Normalisation and the loss compute in f32 whatever the compute dtype, so they keep f32 copies.
"""

from __future__ import annotations

import math

from dslc.ir.nodes import DTYPE_BYTES, Layer, Mesh, TensorType
from dslc.layers.attention import context_axes
from dslc.layers.moe import capacity_slots, expert_axes, group_tokens

F32 = 4


def local_numel(t: TensorType, mesh: Mesh, slices: int) -> int:
    """Elements of `t` on one device, for one of `slices` equal slices of the batch."""
    shape = t.local_shape(mesh)
    if not shape:
        return 1
    return -(-shape[0] // slices) * math.prod(shape[1:])


def layer_residuals(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    """Bytes autodiff keeps for `layer`'s backward pass (one slice of the batch, one device)."""
    c = DTYPE_BYTES[compute]
    x = local_numel(layer.input, mesh, slices)
    y = local_numel(layer.output, mesh, slices) if layer.output.rank else 1
    match layer.kind:
        case "linear" | "conv":
            return x * c  # the operand, for the kernel's gradient
        case "swiglu":
            return x * c + 4 * y * c  # operand, gate, its sigmoid, silu(gate), up
        case "embed":
            # The one-hot matrix [tokens, vocab on this device]: the lookup is a contraction.
            vocab = int(layer.attr("vocab"))  # type: ignore[call-overload]
            split = mesh.size(layer.weight("table").type.sharding[0])
            return x * (-(-vocab // split)) * c
        case "layernorm":
            return 3 * x * F32  # in f32: x - mean, its square, the normalised value
        case "rmsnorm":
            return 2 * x * F32  # in f32: x, the normalised value
        case "gelu":
            return 5 * x * c  # the input and four terms of the tanh approximation
        case "silu":
            return 2 * x * c  # the input and its sigmoid
        case "relu" | "dropout":
            return x * c
        case "attention":
            return _attention(layer, mesh, compute, slices)
        case "moe":
            return _moe(layer, mesh, compute, slices)
        case "cross_entropy":
            return 2 * x * F32  # the f32 one-hot targets and exp(logits)
        case "mse":
            return x * F32
        case _:
            return (x + y) * c  # unknown kinds: input and output


def _attention_sizes(layer: Layer, mesh: Mesh, slices: int) -> tuple[int, int, int, int, int]:
    """Elements on one device of the operand, the queries, the keys and values together, the
    scores of one query block against one key block, and the rows of those scores."""
    # The operand, not the input: sequence parallelism gathers the tokens first, and under
    # context parallelism the layer works on its own share of them.
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    b, s, _ = operand.local_shape(mesh)
    b = -(-b // slices)
    h, kv, hd = (int(layer.attr(n)) for n in ("heads", "kv_heads", "head_dim"))  # type: ignore[call-overload]
    h_local = h // mesh.size(layer.weight("q").type.sharding[1])
    kv_local = kv // mesh.size(layer.weight("k").type.sharding[1])
    rows = b * h_local * s
    return local_numel(operand, mesh, slices), rows * hd, 2 * b * s * kv_local * hd, rows * s, rows


def _attention(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    c = DTYPE_BYTES[compute]
    x, q, k_v, scores, rows = _attention_sizes(layer, mesh, slices)
    if context_axes(layer, mesh):
        # Ring attention keeps no scores: its backward recomputes them block by block from
        # the log-sum-exp of each query row (f32). Zig-zagged (causal), the outputs are kept
        # twice: in that layout for the ring's backward, in token order for the output
        # projection's.
        outputs = 2 if layer.attr("causal") else 1
        return x * c + (q + k_v + outputs * q) * c + rows * F32  # operand, q, k, v, outputs, lse
    # The scores [b, heads, s, s]: the masked scores, their exp and the probabilities in f32,
    # the mask itself, and the probabilities in the compute dtype when that is not f32.
    kept_probs = scores * (3 * F32 + 1 + (c if c != F32 else 0))
    return x * c + (2 * q + k_v) * c + kept_probs  # operand, q, k, v, mixed heads, probs


def _moe_sizes(layer: Layer, mesh: Mesh, slices: int) -> tuple[int, int, int, int, int]:
    """On one device: the operand's elements, the tokens x experts of its router
    probabilities, the slots per expert and routing group, the slots it computes, and the
    width of a slot's activations (dim + hidden)."""
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    x = local_numel(operand, mesh, slices)
    d, f, e = (int(layer.attr(n)) for n in ("dim", "hidden", "experts"))  # type: ignore[call-overload]
    per_group = group_tokens(layer.input)
    tokens = x // d
    slots = capacity_slots(dict(layer.attrs), per_group)
    # Split tokens reach their experts by all-to-all, and a device computes as many slots as
    # its own groups fill; tokens whole along the expert axes fill only its experts' slots.
    axes = expert_axes(layer, mesh)
    exchanged = bool(set(axes) & set(operand.sharding[0]))
    computed = (tokens // per_group) * e * slots // (1 if exchanged else mesh.size(axes))
    return x, tokens * e, slots, computed, d + f


def _moe(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    """The kernel's (dslc.kernels.layers.moe): the operand; the router's probabilities (f32);
    the dispatch and combine tensors [groups, tokens, experts, slots]; and for every slot this
    device computes, its input and output (dim each) and the hidden layer before and after the
    GELU. (XLA recomputes the one-hot choices and the GELU's terms inside the backward's
    fusions rather than keeping them.)"""
    c = DTYPE_BYTES[compute]
    x, probs, slots, computed, width = _moe_sizes(layer, mesh, slices)
    return x * c + probs * F32 + 2 * probs * slots * c + 2 * computed * width * c


def _moe_workspace(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    """The gradients of the operand and of the slots, their hidden layer included. (Fitted
    against XLA's memory analysis of moe_small's gradient step: planned / measured 1.04 on
    2x4 and 0.94 on 1x1; without checkpointing 1.01 and 0.87.)"""
    x, _, _, computed, width = _moe_sizes(layer, mesh, slices)
    return (x + computed * width) * DTYPE_BYTES[compute]


def weight_copies(layer: Layer, mesh: Mesh, compute: str) -> int:
    """Weights cast to the compute dtype: the backward pass keeps the cast copies."""
    return sum(w.type.local_nbytes(mesh) // DTYPE_BYTES[w.type.dtype] * DTYPE_BYTES[compute] for w in layer.weights)


def layer_workspace(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    """The largest transient while the layer's backward runs: its residuals' gradients
    (for attention, the f32 gradient of the scores) live next to the residuals themselves."""
    if layer.kind == "moe":
        return _moe_workspace(layer, mesh, compute, slices)
    if not context_axes(layer, mesh):
        return layer_residuals(layer, mesh, compute, slices)
    # Ring attention's backward adds its gradients up in f32 accumulators as it goes (dq, and
    # dk, dv travelling with the blocks: sent and received) rather than holding gradients of
    # all its residuals at once; its largest transients are one block's scores recomputed,
    # their probabilities and the gradients of both (f32).
    _, q, k_v, scores, _ = _attention_sizes(layer, mesh, slices)
    return 4 * scores * F32 + (q + 2 * k_v) * F32
