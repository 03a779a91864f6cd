"""An independent single-device reference for the numerics of a checked spec.

Given the IR, a weights dict (dotted name -> array, as `Program.export_weights` gives) and a
batch, it computes the activation fed to the loss, the loss and the gradient of the loss with
respect to every weight, with plain `jax.numpy` on one device: no mesh, no sharding, nothing
from `dslc.lower` and no `LayerRule.apply`. Each layer kind's math is written out here a
second time, on purpose in a different form from the backend's where there is a choice
(a gather rather than a one-hot product for embeddings, attention per head with the key/value
heads repeated rather than a grouped einsum, convolution as a sum of shifted matrix products).

Precision follows the spec's `train` section: weights are stored in `param_dtype` and cast to
`compute_dtype` where they are used; every matrix product takes operands in the compute dtype,
accumulates in f32 and rounds its result to the compute dtype; every layer's output has the
dtype the IR gives it. Statistics (norms, softmax, log-sum-exp, the loss) are computed in f32.
Dropout is the identity: forward, loss and gradients are evaluated with dropout off.

A mixture of experts also returns auxiliary values (its load-balancing loss, which joins the
loss, and its dropped and routed choice counts); they are summed over the layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import erf

from dslc.ir import nodes as ir

DTYPES: dict[str, Any] = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f64": jnp.float64,
    "i32": jnp.int32,
    "i64": jnp.int64,
    "i8": jnp.int8,
    "bool": jnp.bool_,
}

Array = jax.Array
Weights = dict[str, Array]
Aux = dict[str, Array]


@dataclass(frozen=True)
class Reference:
    """What the reference computed: the activation fed to the loss (the model's last output
    when there is no loss), the loss (None without one; the layers' auxiliary losses
    included), the gradient of every weight, and the layers' auxiliary values summed."""

    output: np.ndarray
    loss: float | None
    grads: dict[str, np.ndarray]
    aux: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Context:
    compute: Any
    batch: Mapping[str, Array]
    # Set when the caller overrides the compute dtype: every float activation takes it.
    every_float: bool = False
    # The streams computed so far, by name (cross-attention's memory, a position bias).
    streams: dict[str, Array] = field(default_factory=dict)

    def read(self, name: object) -> Array:
        """A declared input or a stream, by the name a layer's argument gives."""
        return self.streams[str(name)] if str(name) in self.streams else self.batch[str(name)]

    def dtype(self, t: ir.TensorType) -> Any:
        """The dtype of an activation the IR types as `t`."""
        return self.compute if self.every_float and t.dtype in ir.FLOAT_DTYPES else DTYPES[t.dtype]


def evaluate(
    program: ir.Program,
    weights: Mapping[str, Any],
    batch: Mapping[str, Any],
    compute_dtype: str | None = None,
) -> Reference:
    """Run `program` on one device with `weights` and `batch` (see the module docstring).

    `compute_dtype` replaces the spec's, for every float activation too: "f32" gives the
    exact result that a bf16 spec approximates."""
    device = jax.devices()[0]
    declared = ir.weights_by_path(program)
    assert set(weights) == set(declared), sorted(set(weights) ^ set(declared))
    params = {
        name: jax.device_put(np.asarray(weights[name]).astype(DTYPES[w.type.dtype]), device)
        for name, w in declared.items()
    }
    inputs = {
        i.name: jax.device_put(np.asarray(batch[i.name]).astype(DTYPES[i.type.dtype]), device)
        for i in program.inputs
        if i.name in batch
    }
    body, loss_layer = _split_loss(program)
    ctx = _Context(DTYPES[compute_dtype or program.train.compute_dtype], inputs, every_float=compute_dtype is not None)

    def forward(p: Weights) -> tuple[Array, Aux]:
        ctx.streams.clear()  # traced anew for each transformation
        return _run(body, inputs[program.stream], p, ctx)

    if loss_layer is None:
        output, aux = jax.jit(forward)(params)
        return Reference(np.asarray(output), None, {}, _floats(aux))

    def loss(p: Weights) -> tuple[Array, tuple[Array, Aux]]:
        y, aux = forward(p)
        value = LOSSES[loss_layer.kind](loss_layer, y, ctx)
        return (value + aux["aux_loss"] if "aux_loss" in aux else value), (y, aux)

    (value, (output, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    grads = {name: np.asarray(g) for name, g in grads.items()}
    return Reference(np.asarray(output), float(value), grads, _floats(aux))


def _floats(aux: Aux) -> dict[str, float]:
    return {name: float(value) for name, value in aux.items()}


def _split_loss(program: ir.Program) -> tuple[list[ir.Node], ir.Layer | None]:
    nodes = [node for chunk in program.chunks for node in chunk.nodes]
    last = nodes[-1] if nodes else None
    if isinstance(last, ir.Layer) and last.kind in LOSSES:
        return nodes[:-1], last
    return nodes, None


def _same(path: str) -> str:
    return path


def _run(
    nodes: list[ir.Node] | tuple[ir.Node, ...],
    x: Array,
    params: Weights,
    ctx: _Context,
    name: Callable[[str], str] = _same,
) -> tuple[Array, Aux]:
    """The nodes' output, and the auxiliary values of the layers among them, summed. `name`
    turns a layer's path into the per-layer name of its weights (a repeat's copies are run
    one by one here, each with its own: `blocks.attn` -> `blocks.3.attn`)."""
    aux: Aux = {}
    for node in nodes:
        more: Aux = {}
        match node:
            case ir.Layer():
                w = {
                    weight.name: _weight(weight, params, name(node.path)).astype(ctx.compute) for weight in node.weights
                }
                if node.kind in WITH_AUX:
                    x, more = WITH_AUX[node.kind](node, w, x, ctx)
                else:
                    x = LAYERS[node.kind](node, w, x, ctx)
                x = x.astype(ctx.dtype(node.output))
            case ir.Residual():
                y, more = _run(node.body, x, params, ctx, name)
                x = (x + y).astype(ctx.dtype(node.output))
            case ir.Branches():
                y = None
                for arm in node.arms:
                    out, one = _run(arm, x, params, ctx, name)
                    y = out if y is None else y + out
                    more = {k: more.get(k, 0.0) + one.get(k, 0.0) for k in {*more, *one}}
                x = y.astype(ctx.dtype(node.output))
            case ir.Stream():
                ctx.streams[node.path], more = _run(node.body, ctx.batch[node.source], params, ctx, name)
            case ir.Block():
                # Checkpointing changes what is stored, never a number.
                x, more = _run(node.body, x, params, ctx, name)
            case ir.Repeat():
                for i in range(node.first, node.first + node.count):
                    copy = _indexed(node.path, i, name)
                    x, one = _run((node.body,), x, params, ctx, copy)
                    more = {k: more.get(k, 0.0) + one.get(k, 0.0) for k in {*more, *one}}
            case ir.Layout():
                pass
        aux = {name: aux.get(name, 0.0) + more.get(name, 0.0) for name in {*aux, *more}}
    return x, aux


def _weight(weight: ir.Weight, params: Weights, path: str) -> Array:
    """A layer's weight by its per-layer name; a tied one is the weight it reads (turned)."""
    if weight.tie is None:
        return params[f"{path}.{weight.name}"]
    value = params[weight.tie.name]
    return value.T if weight.tie.transposed else value


def _indexed(prefix: str, i: int, outer: Callable[[str], str]) -> Callable[[str], str]:
    """Paths under a repeat's `prefix`, in its copy i."""

    def name(path: str) -> str:
        return outer(f"{prefix}.{i}{path[len(prefix) :]}" if path == prefix or path.startswith(prefix + ".") else path)

    return name


# ---- arithmetic -------------------------------------------------------------------------------


def _matmul(spec: str, a: Array, b: Array, ctx: _Context) -> Array:
    """A product with operands in the compute dtype, f32 accumulation, compute-dtype result."""
    out = jnp.einsum(
        spec,
        a.astype(ctx.compute),
        b.astype(ctx.compute),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.astype(ctx.compute)


def _f32(x: Array) -> Array:
    return x.astype(jnp.float32)


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _softmax(x: Array) -> Array:
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
    return e / e.sum(-1, keepdims=True)


def _logsumexp(x: Array) -> Array:
    m = jax.lax.stop_gradient(x.max(-1, keepdims=True))
    return (m + jnp.log(jnp.exp(x - m).sum(-1, keepdims=True)))[..., 0]


# ---- the layer kinds --------------------------------------------------------------------------


def linear(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    y = _matmul("...i,io->...o", x, w["kernel"], ctx)
    return y + w["bias"] if "bias" in w else y


def swiglu(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    gate = _f32(_matmul("...i,io->...o", x, w["gate"], ctx))
    up = _f32(_matmul("...i,io->...o", x, w["up"], ctx))
    if layer.attr("activation") == "gelu":
        return _gelu_tanh(gate) * up
    return gate * _sigmoid(gate) * up


def embed(layer: ir.Layer, w: Weights, ids: Array, ctx: _Context) -> Array:
    y = w["table"][ids]
    return y * np.sqrt(w["table"].shape[1]) if layer.attr("scale") else y


def position_embed(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    positions = np.arange(x.shape[-2])
    return x + jnp.take(w["table"], positions, axis=0)


def layernorm(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    h = _f32(x)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    eps = float(layer.attr("eps"))  # type: ignore[arg-type]
    y = (h - mean) / jnp.sqrt(var + eps) * _f32(w["scale"])
    return y + _f32(w["bias"]) if "bias" in w else y


def rmsnorm(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    h = _f32(x)
    eps = float(layer.attr("eps"))  # type: ignore[arg-type]
    scale = 1 + _f32(w["scale"]) if layer.attr("offset") else _f32(w["scale"])
    return h / jnp.sqrt((h**2).mean(-1, keepdims=True) + eps) * scale


def _rotate(t: Array, base: float, positions: np.ndarray, dims: int | None = None) -> Array:
    """Rotary embedding, rotate-half convention, on [batch, seq, heads, head_dim] at
    `positions` [batch, seq]; f32. With `dims`, on each head's first `dims` features only."""
    if dims is not None:
        return jnp.concatenate([_rotate(t[..., :dims], base, positions), _f32(t[..., dims:])], axis=-1)
    head_dim = t.shape[3]
    half = head_dim // 2
    freqs = base ** (-np.arange(half, dtype=np.float64) / half)
    angle = positions.astype(np.float64)[:, :, None] * freqs[None, None, :]
    cos = jnp.asarray(np.cos(angle), jnp.float32)[:, :, None, :]
    sin = jnp.asarray(np.sin(angle), jnp.float32)[:, :, None, :]
    t1, t2 = _f32(t[..., :half]), _f32(t[..., half:])
    return jnp.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos], axis=-1)


def attention(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    heads, kv_heads, head_dim = layer.attr("heads"), layer.attr("kv_heads"), layer.attr("head_dim")
    assert isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)
    b, s, _ = x.shape
    # Cross-attention: keys and values from the memory, a sequence of its own.
    memory = ctx.read(layer.attr("memory")).astype(ctx.compute) if layer.attr("memory") is not None else x

    def project(name: str, n: int, source: Array) -> Array:
        y = _matmul("bsd,de->bse", source, w[name], ctx)
        return (y + w[f"{name}_bias"] if f"{name}_bias" in w else y).reshape(b, source.shape[1], n, head_dim)

    q, k, v = project("q", heads, x), project("k", kv_heads, memory), project("v", kv_heads, memory)
    if layer.attr("qk_norm"):
        # Each head's query and key RMS-normalised over its features, then scaled.
        eps = float(layer.attr("norm_eps"))  # type: ignore[arg-type]
        q, k = (
            (_f32(t) / jnp.sqrt((_f32(t) ** 2).mean(-1, keepdims=True) + eps)).astype(ctx.compute) * w[name]
            for t, name in ((q, "q_norm"), (k, "k_norm"))
        )
    # Documents packed into a sequence: ids [b, s]; one document when not given.
    segments = layer.attr("segments")
    docs = np.asarray(ctx.batch[str(segments)]) if segments is not None else np.zeros((b, s), np.int64)
    if layer.attr("rope"):
        # A token's place in its own document: how many tokens of it come before it.
        positions = np.zeros((b, s), np.int64)
        for row in range(b):
            for t in range(1, s):
                same = docs[row, t] == docs[row, t - 1]
                positions[row, t] = positions[row, t - 1] + 1 if same else 0
        base = float(layer.attr("rope_base"))  # type: ignore[arg-type]
        dims = layer.attr("rope_dims")
        assert dims is None or isinstance(dims, int)
        q = _rotate(q, base, positions, dims).astype(ctx.compute)
        k = _rotate(k, base, positions, dims).astype(ctx.compute)
    # Query head i reads key/value head i // (heads // kv_heads).
    group = heads // kv_heads
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    # Every query head attends on its own, to its own (repeated) key/value head.
    scale = layer.attr("scale")
    scores = _f32(_matmul("bqhd,bkhd->bhqk", q, k, ctx)) * (1 / math.sqrt(head_dim) if scale is None else scale)
    cap = layer.attr("softcap")
    if cap is not None:
        scores = float(cap) * jnp.tanh(scores / float(cap))  # type: ignore[arg-type]
    if layer.attr("position_bias") is not None:
        scores = scores + _f32(ctx.read(layer.attr("position_bias")))
    # Which keys each query may not see [b, q, k]: later ones (causal), those more than a
    # window back, those of another document.
    keys = memory.shape[1]
    query, key = np.arange(s)[:, None], np.arange(keys)[None, :]
    hidden = (
        np.zeros((b, s, keys), bool) if keys != s else np.broadcast_to(docs[:, :, None] != docs[:, None, :], (b, s, s))
    )
    if layer.attr("causal"):
        hidden = hidden | (key > query)[None]
    window = layer.attr("window")
    if window is not None:
        hidden = hidden | (query - key >= int(window))[None]  # type: ignore[call-overload]
    scores = jnp.where(hidden[:, None], -jnp.inf, scores)
    out = _matmul("bhqk,bkhd->bqhd", _softmax(scores), v, ctx).reshape(b, s, heads * head_dim)
    y = _matmul("bse,ed->bsd", out, w["o"], ctx)
    return y + w["o_bias"] if "o_bias" in w else y


def relative_position_bias(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    """T5's bucketed relative positions, as its `_relative_position_bucket` writes them:
    key - query distances, half the buckets exact, the rest logarithmic up to max_distance."""
    s = x.shape[1]
    relative = np.arange(s)[None, :] - np.arange(s)[:, None]
    n = int(layer.attr("buckets"))  # type: ignore[call-overload]
    far_end = int(layer.attr("max_distance"))  # type: ignore[call-overload]
    bucket = np.zeros((s, s), np.int64)
    if layer.attr("bidirectional"):
        n //= 2
        bucket += (relative > 0).astype(np.int64) * n
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    exact = n // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(relative.astype(np.float32) / exact) / math.log(far_end / exact) * (n - exact))
    large = np.minimum(np.where(relative < exact, 0, large).astype(np.int64), n - 1)
    bucket += np.where(relative < exact, relative, large)
    return jnp.transpose(w["table"][bucket], (2, 0, 1))[None]


def gelu(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    if layer.attr("approximate"):
        return _gelu_tanh(_f32(x))
    return 0.5 * _f32(x) * (1.0 + erf(_f32(x) / math.sqrt(2.0)))


def relu(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    return jnp.where(x > 0, x, jnp.zeros_like(x))


def silu(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    h = _f32(x)
    return h * _sigmoid(h)


def softcap(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    cap = float(layer.attr("cap"))  # type: ignore[arg-type]
    return cap * jnp.tanh(_f32(x) / cap)


def dropout(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    return x


def conv(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    """'same' padding as XLA defines it (the odd pixel of padding goes after), as a sum over
    the window of strided slices each multiplied by one tap of the kernel."""
    size, stride = layer.attr("kernel"), layer.attr("stride")
    assert isinstance(size, int) and isinstance(stride, int)
    _, height, width, _ = x.shape
    out_h, out_w = -(-height // stride), -(-width // stride)
    pad_h = max((out_h - 1) * stride + size - height, 0)
    pad_w = max((out_w - 1) * stride + size - width, 0)
    padded = jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    y = jnp.zeros((*x.shape[:1], out_h, out_w, w["kernel"].shape[3]), jnp.float32)
    for i in range(size):
        for j in range(size):
            window = padded[:, i : i + (out_h - 1) * stride + 1 : stride, j : j + (out_w - 1) * stride + 1 : stride, :]
            y = y + _f32(_matmul("bhwi,io->bhwo", window, w["kernel"][i, j], ctx))
    y = y.astype(ctx.compute)
    return y + w["bias"] if "bias" in w else y


def flatten(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    """The grid's vectors in reading order: row 0 left to right, then row 1, ... (ViT's
    `flatten(2).transpose(1, 2)` of the conv's [batch, dim, height, width])."""
    _, height, width, _ = x.shape
    return jnp.stack([x[:, i, j] for i in range(height) for j in range(width)], axis=1)


def class_token(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    token = jnp.tile(w["token"][None, None, :], (x.shape[0], 1, 1))
    return jnp.concatenate([token.astype(x.dtype), x], axis=1)


def pool(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> Array:
    return x[:, 0] if layer.attr("mode") == "first" else _f32(x).sum(axis=1) / x.shape[1]


def _expert_hidden(h: Array, w_in: Array, w_gate: Array | None, activation: str, ctx: _Context) -> Array:
    """An expert's (or the shared experts') hidden layer on h, in f32, written out."""
    up = _f32(_matmul("...d,df->...f", h, w_in, ctx))
    if w_gate is not None:
        gate = _f32(_matmul("...d,df->...f", h, w_gate, ctx))
        act = gate * _sigmoid(gate) if activation == "swiglu" else _gelu_tanh(gate)
        return act * up
    if activation == "gelu":
        return _gelu_tanh(up)
    if activation == "silu":
        return up * _sigmoid(up)
    assert activation == "relu", activation
    return jnp.where(up > 0, up, 0.0)


def moe(layer: ir.Layer, w: Weights, x: Array, ctx: _Context) -> tuple[Array, Aux]:
    """Every sequence (one row of the batch, all its positions) is routed on its own. With a
    capacity, each expert has ceil(capacity * tokens * top_k / experts) places per sequence
    (at most `tokens`), filled by every token's first choice in token order, then by the
    second choices, and so on; a choice that finds no place adds nothing; without one
    (`capacity=none`) every choice finds a place. Every expert is computed on every token,
    densely, and weighted by the gates of the choices that found a place; the shared experts
    are one more MLP on every token, scaled by sigmoid(x @ s_router) where there is one."""
    experts, top_k, factor, weight = (layer.attr(n) for n in ("experts", "top_k", "capacity", "aux_weight"))
    z_weight, normalize, activation = (layer.attr(n) for n in ("z_weight", "normalize", "activation"))
    assert isinstance(experts, int) and isinstance(top_k, int) and isinstance(activation, str)
    assert isinstance(factor, float | None) and isinstance(weight, float) and isinstance(z_weight, float)
    b, d = x.shape[0], x.shape[-1]
    h = x.reshape(b, -1, d)
    s = h.shape[1]
    places = s * top_k if factor is None else min(s, math.ceil(factor * s * top_k / experts))
    logits = _f32(_matmul("gsd,de->gse", h, w["router"], ctx))
    probs = _softmax(logits)
    # The k most probable experts per token, by sorting (ties do not occur with real data);
    # with a balancing bias, by the probabilities plus the bias.
    scores = probs + w["balance_bias"] if "balance_bias" in w else probs
    chosen = jnp.argsort(-jax.lax.stop_gradient(scores), axis=-1)[..., :top_k]  # [b, s, k]
    picked = jnp.take_along_axis(probs, chosen, axis=-1)
    gates = picked / picked.sum(-1, keepdims=True) if normalize else picked
    # Choice j of token t ranks j * s + t; its place is the number of choices of the same
    # sequence that rank before it and picked the same expert.
    rank = (np.arange(top_k)[None, :] * s + np.arange(s)[:, None]).reshape(-1)
    flat = chosen.reshape(b, s * top_k)
    same_expert = flat[:, :, None] == flat[:, None, :]
    place = jnp.sum(same_expert & (rank[None, :] < rank[:, None])[None], axis=-1).reshape(b, s, top_k)
    found = place < places
    y = jnp.zeros(h.shape, jnp.float32)
    for e in range(experts):
        gate = jnp.where((chosen == e) & found, gates, 0.0).sum(-1, keepdims=True)
        hidden = _expert_hidden(h, w["w_in"][e], w["w_gate"][e] if "w_gate" in w else None, activation, ctx)
        y = y + gate * _f32(_matmul("gsf,fd->gsd", hidden, w["w_out"][e], ctx))
    if "s_in" in w:
        hidden = _expert_hidden(h, w["s_in"], w.get("s_gate"), activation, ctx)
        shared = _f32(_matmul("gsf,fd->gsd", hidden, w["s_out"], ctx))
        if "s_router" in w:
            shared = shared * _sigmoid(_f32(_matmul("gsd,do->gso", h, w["s_router"], ctx)))
        y = y + shared
    # Switch Transformer's loss, per sequence: experts * sum over e of (the share of the
    # sequence's choices that picked e) * (e's mean router probability), then the mean.
    counts = jnp.stack([jnp.sum(chosen == e, axis=(1, 2)) for e in range(experts)], axis=-1)  # [b, experts]
    share = counts / (s * top_k)
    balance = experts * jnp.sum(share * probs.mean(axis=1), axis=-1)
    z = jnp.mean(_logsumexp(logits) ** 2)
    load = counts.sum(0)
    # The balancing bias's "gradient" is the batch's excess share of the choices per expert:
    # a term of value 0 whose derivative with respect to the bias is that.
    signal = 0.0
    if "balance_bias" in w:
        excess = jax.lax.stop_gradient(load / jnp.sum(load) - 1.0 / experts)
        signal = jnp.sum(w["balance_bias"] * excess) - jax.lax.stop_gradient(jnp.sum(w["balance_bias"] * excess))
    aux = {
        "aux_loss": weight * balance.mean() + z_weight * z + signal,
        "moe_z_loss": z_weight * z,
        "moe_dropped": jnp.sum(~found).astype(jnp.float32),
        "moe_routed": jnp.asarray(b * s * top_k, jnp.float32),
        "moe_load_max": experts * jnp.max(load) / jnp.sum(load),
        "moe_layers": jnp.ones((), jnp.float32),
    }
    return y.reshape(x.shape), aux


LayerMath = Callable[[ir.Layer, Weights, Array, _Context], Array]

LAYERS: dict[str, LayerMath] = {
    "linear": linear,
    "swiglu": swiglu,
    "embed": embed,
    "position_embed": position_embed,
    "layernorm": layernorm,
    "rmsnorm": rmsnorm,
    "attention": attention,
    "relative_position_bias": relative_position_bias,
    "gelu": gelu,
    "relu": relu,
    "silu": silu,
    "softcap": softcap,
    "dropout": dropout,
    "conv": conv,
    "flatten": flatten,
    "class_token": class_token,
    "pool": pool,
}
# Layers that return auxiliary values besides their output.
WITH_AUX: dict[str, Callable[[ir.Layer, Weights, Array, _Context], tuple[Array, Aux]]] = {"moe": moe}


# ---- losses -----------------------------------------------------------------------------------


def cross_entropy(layer: ir.Layer, logits: Array, ctx: _Context) -> Array:
    """The mean over the positions counted: a target other than `ignore_index`, and a
    nonzero mask where the layer reads one."""
    logits = _f32(logits)
    targets = ctx.batch[str(layer.attr("targets"))]
    counted = targets != layer.attr("ignore_index")
    if layer.attr("mask") is not None:
        counted = counted & (ctx.batch[str(layer.attr("mask"))] != 0)
    picked = jnp.where(counted, targets, 0)
    target_logit = jnp.take_along_axis(logits, picked[..., None], axis=-1)[..., 0]
    losses = jnp.where(counted, _logsumexp(logits) - target_logit, 0.0)
    return losses.sum() / jnp.maximum(counted.sum(), 1)


def mse(layer: ir.Layer, y: Array, ctx: _Context) -> Array:
    diff = _f32(y) - _f32(ctx.batch[str(layer.attr("targets"))])
    return jnp.mean(diff**2)


LOSSES: dict[str, Callable[[ir.Layer, Array, _Context], Array]] = {"cross_entropy": cross_entropy, "mse": mse}
