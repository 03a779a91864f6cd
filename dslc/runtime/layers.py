"""One function per layer kind, on global (logical) arrays.

Conventions, shared by every kernel (attention's are in `attention.py`, the mixture of experts'
in `experts.py`) so that a generated module calls them alike:
the input activation is the first argument; weights follow as keyword arguments named as
the layer rule names them (already cast to the compute dtype); then the layer's static
arguments, keyword-only; `dtype` is the compute dtype's name. Sharding is not a kernel's
business: the caller pins inputs and outputs to the shardings the checker gave them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# ---- matrix products -----------------------------------------------------------------------------


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, dtype: str) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x.astype(dtype), kernel)
    return y if bias is None else y + bias


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, *, dtype: str, activation: str = "silu") -> jax.Array:
    """activation(x @ gate) * (x @ up): SwiGLU with "silu", GeGLU (the tanh GeLU) with "gelu"."""
    x = x.astype(dtype)
    return gated(jnp.einsum("...i,io->...o", x, gate), jnp.einsum("...i,io->...o", x, up), activation)


def embed(ids: jax.Array, table: jax.Array, *, dtype: str, scale: bool = False) -> jax.Array:
    # A one-hot contraction rather than a gather: with the table split over the vocabulary
    # it is exactly Megatron's masked local lookup followed by one all-reduce.
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=dtype)
    y = jnp.einsum("...v,vd->...d", one_hot, table)
    # Gemma scales by sqrt(dim) rounded to the compute dtype, as its checkpoints expect.
    return y * jnp.asarray(table.shape[1] ** 0.5, dtype) if scale else y


def position_embed(x: jax.Array, table: jax.Array) -> jax.Array:
    # Row i of the table for position i, the same for every sequence of the batch.
    return x + table[: x.shape[-2]]


def conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, stride: int, dtype: str) -> jax.Array:
    y = lax.conv_general_dilated(
        x.astype(dtype),
        kernel,
        window_strides=(stride, stride),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y if bias is None else y + bias


def flatten(x: jax.Array) -> jax.Array:
    """A grid [batch, height, width, dim] read row by row as a sequence [batch, height * width, dim]."""
    b, h, w, d = x.shape
    return x.reshape(b, h * w, d)


def class_token(x: jax.Array, token: jax.Array, *, dtype: str) -> jax.Array:
    """The learned `token` prepended to every sequence of [batch, seq, dim]."""
    first = jnp.broadcast_to(token.astype(x.dtype), (x.shape[0], 1, x.shape[2]))
    return jnp.concatenate([first, x], axis=1)


def pool(x: jax.Array, *, mode: str) -> jax.Array:
    """[batch, seq, dim] -> [batch, dim]: the mean over the sequence (summed in f32), or its first vector."""
    if mode == "first":
        return x[:, 0]
    return x.astype(jnp.float32).mean(axis=1).astype(x.dtype)


# ---- normalisation -------------------------------------------------------------------------------
#
# A norm keeps for its backward pass only its input, as given (16-bit under mixed precision),
# and its per-row statistics in f32, and recomputes the normalised value from them: autodiff
# of the plain formula would keep three input-sized f32 copies (x - mean, its square, the
# normalised value), 12 bytes an element where 2 (and 8 a row) do.


def layernorm(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *, eps: float, dtype: str) -> jax.Array:
    # Statistics in f32 whatever the compute dtype: bf16 means lose too much.
    return _norm(x, _varying_like(scale, x), None if bias is None else _varying_like(bias, x), eps, dtype, True)


def rmsnorm(x: jax.Array, scale: jax.Array, *, eps: float, dtype: str, offset: bool = False) -> jax.Array:
    """`offset`: the scale applied is 1 + the stored one (Gemma's norms)."""
    return _norm(x, _varying_like(1 + scale if offset else scale, x), None, eps, dtype, False)


def _varying_like(w: jax.Array, x: jax.Array) -> jax.Array:
    """A weight typed as differing wherever x does inside a shard_map, as autodiff would type
    it before multiplying (a custom backward pass returns the weight's gradient as it is
    typed: summed over those axes by this cast's own backward, in f32)."""
    missing = tuple(sorted(jax.typeof(x).mat.varying - jax.typeof(w).mat.varying))
    if not missing:
        return w
    return lax.pcast(w.astype(jnp.float32), missing, to="varying").astype(w.dtype)


def _normalised(x: jax.Array, eps: float, centred: bool) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """(x - mean) / rms in f32 (no mean taken when not `centred`), with the mean and 1 / rms."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True) if centred else None
    c = h if mean is None else h - mean
    inv = lax.rsqrt((c * c).mean(-1, keepdims=True) + eps)
    return c * inv, mean, inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, dtype: str, centred: bool) -> jax.Array:
    y = _normalised(x, eps, centred)[0].astype(dtype) * scale
    return y if bias is None else y + bias


NormSaved = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array]


def _norm_forward(
    x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float, dtype: str, centred: bool
) -> tuple[jax.Array, NormSaved]:
    normalised, mean, inv = _normalised(x, eps, centred)
    y = normalised.astype(dtype) * scale
    return (y if bias is None else y + bias), (x, scale, bias, mean, inv)


def _norm_backward(
    eps: float, dtype: str, centred: bool, saved: NormSaved, cotangent: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    # The barrier keeps XLA from merging this recomputation with the forward pass's, which
    # would hold the f32 normalised value from the forward pass to here after all.
    x, scale, bias, mean, inv = saved
    x, mean, inv = lax.optimization_barrier((x, mean, inv))
    h = x.astype(jnp.float32)
    normalised = (h if mean is None else h - mean) * inv
    g = cotangent.astype(jnp.float32)
    rows = tuple(range(g.ndim - 1))
    # The scale multiplied the normalised value as rounded to the compute dtype.
    d_scale = jnp.sum(g * normalised.astype(dtype).astype(jnp.float32), rows).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, rows).astype(bias.dtype)
    # d/dx of (x - mean) / rms: the gradient less its projections on the constant row (when
    # centred) and on the normalised value, over rms.
    gs = g * scale.astype(jnp.float32)
    d_x = gs - normalised * jnp.mean(gs * normalised, -1, keepdims=True)
    if centred:
        d_x = d_x - jnp.mean(gs, -1, keepdims=True)
    return (d_x * inv).astype(x.dtype), d_scale, d_bias


_norm.defvjp(_norm_forward, _norm_backward)


# ---- elementwise ---------------------------------------------------------------------------------
#
# An activation keeps only its input and recomputes its derivative from it (autodiff of the
# tanh GeLU keeps the input and four of its terms), and a gated one (SwiGLU, GeGLU) its two
# operands; dropout keeps its 1-byte mask rather than its 16-bit output.


def gelu(x: jax.Array, *, approximate: bool) -> jax.Array:
    return _activation(x, "gelu" if approximate else "gelu_exact")


def relu(x: jax.Array) -> jax.Array:
    return jax.nn.relu(x)


def silu(x: jax.Array) -> jax.Array:
    return _activation(x, "silu")


def softcap(x: jax.Array, *, cap: float) -> jax.Array:
    """cap * tanh(x / cap), its backward pass keeping only x."""
    return capped(x, cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def capped(x: jax.Array, cap: float) -> jax.Array:
    return (cap * jnp.tanh(x.astype(jnp.float32) / cap)).astype(x.dtype)


def _capped_forward(x: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    return capped(x, cap), x


def _capped_backward(cap: float, x: jax.Array, cotangent: jax.Array) -> tuple[jax.Array]:
    x = lax.optimization_barrier(x)
    t = jnp.tanh(x.astype(jnp.float32) / cap)
    return ((cotangent.astype(jnp.float32) * (1 - t * t)).astype(x.dtype),)


capped.defvjp(_capped_forward, _capped_backward)


def gated(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """activation(gate) * up ("silu": SwiGLU, "gelu": GeGLU with the tanh GeLU), keeping the
    two operands for the backward pass."""
    return _gated(gate, up, activation)


def _act(x: jax.Array, activation: str) -> jax.Array:
    match activation:
        case "gelu":
            return jax.nn.gelu(x, approximate=True)
        case "gelu_exact":
            return jax.nn.gelu(x, approximate=False)
        case "silu":
            return jax.nn.silu(x)
    raise ValueError(f"activation {activation!r}")


def _act_derivative(x: jax.Array, activation: str) -> jax.Array:
    """d activation / dx at x, in f32."""
    h = x.astype(jnp.float32)
    match activation:
        case "gelu":
            # 0.5 h (1 + tanh(u)), u = sqrt(2/pi) (h + 0.044715 h^3)
            c = math.sqrt(2 / math.pi)
            t = jnp.tanh(c * (h + 0.044715 * h * h * h))
            return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)
        case "gelu_exact":
            # h Phi(h): Phi(h) + h phi(h)
            return 0.5 * (1 + lax.erf(h / math.sqrt(2))) + h * jnp.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
        case "silu":
            s = jax.nn.sigmoid(h)
            return s * (1 + h * (1 - s))
    raise ValueError(f"activation {activation!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(x: jax.Array, activation: str) -> jax.Array:
    return _act(x, activation)


def _activation_forward(x: jax.Array, activation: str) -> tuple[jax.Array, jax.Array]:
    return _act(x, activation), x


def _activation_backward(activation: str, x: jax.Array, cotangent: jax.Array) -> tuple[jax.Array]:
    x = lax.optimization_barrier(x)  # recomputed here, not merged with the forward's terms
    return ((cotangent.astype(jnp.float32) * _act_derivative(x, activation)).astype(x.dtype),)


_activation.defvjp(_activation_forward, _activation_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    return _act(gate, activation) * up


def _gated_forward(gate: jax.Array, up: jax.Array, activation: str) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _act(gate, activation) * up, (gate, up)


def _gated_backward(
    activation: str, saved: tuple[jax.Array, jax.Array], cotangent: jax.Array
) -> tuple[jax.Array, jax.Array]:
    gate, up = lax.optimization_barrier(saved)
    g = cotangent.astype(jnp.float32)
    d_gate = g * up.astype(jnp.float32) * _act_derivative(gate, activation)
    d_up = g * _act(gate, activation).astype(jnp.float32)
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


_gated.defvjp(_gated_forward, _gated_backward)


def dropout(x: jax.Array, *, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when there is no key (evaluation)."""
    if key is None or rate == 0.0:
        return x
    return _dropped(x, jax.random.bernoulli(key, 1.0 - rate, x.shape), rate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dropped(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _dropped_forward(x: jax.Array, keep: jax.Array, rate: float) -> tuple[jax.Array, jax.Array]:
    return _dropped(x, keep, rate), keep


def _dropped_backward(rate: float, keep: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, None]:
    return jnp.where(keep, cotangent / (1.0 - rate), 0).astype(cotangent.dtype), None


_dropped.defvjp(_dropped_forward, _dropped_backward)


# ---- losses (f32, mean over the positions counted) -----------------------------------------------


def cross_entropy(
    logits: jax.Array, *, targets: jax.Array, mask: jax.Array | None = None, ignore_index: int, classes: int = 0
) -> jax.Array:
    """The mean over the positions counted (see `cross_entropy_count`); 0 when none is.
    Logits past the first `classes` (when given) are a padded vocabulary's, out of the softmax."""
    logits = logits.astype(jnp.float32)
    if classes:
        # The lowest finite f32 rather than -inf: it adds nothing to the softmax, and the
        # one-hot product below multiplies it by zero without making a NaN.
        real = jnp.arange(logits.shape[-1]) < classes
        logits = jnp.where(real, logits, jnp.finfo(jnp.float32).min)
    # The target logit picked by a one-hot product: over vocab-split logits this is a local
    # partial sum and one all-reduce (Megatron's vocab-parallel cross-entropy). An ignored
    # target outside the vocabulary picks nothing.
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    counted = _counted(targets, mask, ignore_index)
    losses = jnp.where(counted, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)


def cross_entropy_count(
    *, targets: jax.Array, mask: jax.Array | None = None, ignore_index: int, classes: int = 0
) -> jax.Array:
    """How many positions `cross_entropy` averages over: those whose target is not
    `ignore_index` and whose mask, when given, is not zero (f32). `classes` is the loss's own
    argument, which the count does not need."""
    return jnp.sum(_counted(targets, mask, ignore_index)).astype(jnp.float32)


def _counted(targets: jax.Array, mask: jax.Array | None, ignore_index: int) -> jax.Array:
    counted = targets != ignore_index
    return counted if mask is None else counted & (mask != 0)


def mse(x: jax.Array, *, targets: jax.Array) -> jax.Array:
    diff = x.astype(jnp.float32) - targets.astype(jnp.float32)
    return jnp.mean(diff * diff)
