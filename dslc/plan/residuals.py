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
        case "cross_entropy":
            return 2 * x * F32  # the f32 one-hot targets and exp(logits)
        case "mse":
            return x * F32
        case _:
            return (x + y) * c  # unknown kinds (moe): input and output


def _attention(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    c = DTYPE_BYTES[compute]
    b, s, _ = layer.input.local_shape(mesh)
    b = -(-b // slices)
    h, kv, hd = (int(layer.attr(n)) for n in ("heads", "kv_heads", "head_dim"))  # type: ignore[call-overload]
    tp = mesh.size(layer.weight("q").type.sharding[1])
    kv_tp = mesh.size(layer.weight("k").type.sharding[1])
    h_local, kv_local = h // tp, kv // kv_tp
    x = local_numel(layer.input, mesh, slices)
    q = b * s * h_local * hd
    k_v = 2 * b * s * kv_local * hd
    # The scores [b, heads, s, s]: the masked scores, their exp and the probabilities in f32,
    # the mask itself, and the probabilities in the compute dtype when that is not f32.
    probs = b * h_local * s * s
    kept_probs = probs * (3 * F32 + 1 + (c if c != F32 else 0))
    return x * c + (2 * q + k_v) * c + kept_probs  # operand, q, k, v, mixed heads, probs


def weight_copies(layer: Layer, mesh: Mesh, compute: str) -> int:
    """Weights cast to the compute dtype: the backward pass keeps the cast copies."""
    return sum(w.type.local_nbytes(mesh) // DTYPE_BYTES[w.type.dtype] * DTYPE_BYTES[compute] for w in layer.weights)


def layer_workspace(layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
    """The largest transient while the layer's backward runs: its residuals' gradients
    (for attention, the f32 gradient of the scores) live next to the residuals themselves."""
    return layer_residuals(layer, mesh, compute, slices)
