"""The model as Flax NNX state, and the interpreter that runs the checked IR on it.

Parameters live in one `nnx.Dict` keyed by their stable dotted names (`blocks.3.attn.q`),
each an `nnx.Param` created directly with its declared sharding. The forward pass walks the
IR: each layer is computed by its rule's kernel (`dslc.kernels.layers`) and its output pinned
to the sharding the checker gave it, so the collectives XLA inserts are the ones the IR predicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from dslc.ir import nodes as ir
from dslc.ir.repeats import group_repeats
from dslc.kernels import layers as kernels
from dslc.kernels.layers import add_aux
from dslc.kernels.params import initial_value, named_key
from dslc.layers import LOSS_KINDS, RULES
from dslc.layers.base import input_args
from dslc.lower.runtime import JNP_DTYPES, Runtime

Params = dict[str, jax.Array]


class DslcModel(nnx.Module):
    """All parameters of a compiled spec, sharded over the mesh."""

    def __init__(self, params: Params) -> None:
        self.params = nnx.Dict({name: nnx.Param(value) for name, value in params.items()})

    def arrays(self) -> Params:
        return {name: p[...] for name, p in self.params.items()}


def init_params(program: ir.Program, shardings: dict[str, NamedSharding], seed: int) -> Params:
    """Fresh parameters, each generated straight into its shards (never whole on one device).

    Every weight draws from a key derived from its own name, so a seed gives the same
    weights whatever the mesh or the rest of the model.
    """
    weights = ir.weights_by_path(program)

    def create() -> Params:
        key = jax.random.key(seed)
        return {
            path: initial_value(w.init, w.type.shape, jnp.dtype(JNP_DTYPES[w.type.dtype]).name, named_key(key, path))
            for path, w in weights.items()
        }

    return jax.jit(create, out_shardings=shardings)()


# ---- running the IR ---------------------------------------------------------------------------
#
# Auxiliary values: a layer whose rule has `has_aux` returns (y, aux) from its kernel, aux
# being a dict of f32 scalars. They travel back up as return values, never through a side
# channel (a list appended to inside `lax.scan` or `jax.checkpoint` would leak tracers): every
# function below returns (y, aux), with aux summed key by key over the layers it ran, `{}`
# when none has any. A scan returns its blocks' aux dicts stacked and sums them; a
# checkpointed block returns its aux like its output. `run_loss` adds `aux[AUX_LOSS]` to the
# loss, so its gradient flows through everything the layer computed it from.

Aux = dict[str, jax.Array]


def forward_nodes(nodes: tuple[ir.Node, ...], x: jax.Array, params: Params, rt: Runtime) -> tuple[jax.Array, Aux]:
    """The nodes run in order on `x`: their output, and their layers' auxiliary values."""
    aux: Aux = {}
    for run in group_repeats(nodes):
        x, more = _run(run[0], x, params, rt) if len(run) == 1 else _scan(run, x, params, rt)
        aux = add_aux(aux, more)
    return x, aux


def _scan(run: tuple[ir.Node, ...], x: jax.Array, params: Params, rt: Runtime) -> tuple[jax.Array, Aux]:
    """A run of identical blocks as one `lax.scan` over their stacked weights.

    One loop body instead of N copies keeps compile time flat in depth, and it is what
    makes activation checkpointing save memory: the loop keeps only each block's input,
    and the checkpointed body recomputes the rest during the backward pass. Each step's
    auxiliary values come out stacked, one row per block, and are summed.
    """
    first = run[0]
    assert isinstance(first, ir.Block)
    names = [f"{layer.path}.{w.name}" for layer in ir.layers(first.body) for w in layer.weights]
    suffixes = [name[len(first.path) :] for name in names]
    stacked = {s: jnp.stack([params[block.path + s] for block in run]) for s in suffixes}
    base_key = rt.dropout_key

    def body(h: jax.Array, step: tuple[jax.Array, dict[str, jax.Array]]) -> tuple[jax.Array, Aux]:
        index, weights = step
        if base_key is not None:
            rt.dropout_key = jax.random.fold_in(base_key, index)
        local = {first.path + s: w for s, w in weights.items()}
        return _run(first, h, local, rt)

    y, aux = jax.lax.scan(body, x, (jnp.arange(len(run)), stacked))
    rt.dropout_key = base_key
    return y, {k: v.sum(0) for k, v in aux.items()}


def _run(node: ir.Node, x: jax.Array, params: Params, rt: Runtime) -> tuple[jax.Array, Aux]:
    match node:
        case ir.Layer():
            # Parameters stored split over the data axes (ZeRO-3 / FSDP) are gathered to the
            # layout the layer computes with; for the others this constraint changes nothing.
            weights = {
                w.name: rt.constrain(params[f"{node.path}.{w.name}"], w.type.sharding).astype(rt.compute_dtype)
                for w in node.weights
            }
            if node.operand != node.input.sharding:
                x = rt.constrain(x, node.operand)
            y, aux = call_kernel(node, x, weights, rt)
            if node.output.rank:
                y = rt.constrain(y, node.output.sharding)
            return rt.name(y, node.path), aux
        case ir.Residual():
            y, aux = forward_nodes(node.body, x, params, rt)
            return x + y, aux
        case ir.Block():

            def body(h: jax.Array, p: Params) -> tuple[jax.Array, Aux]:
                return forward_nodes(node.body, h, p, rt)

            return _remat(node, body)(x, params)
        case ir.Layout():
            return rt.constrain(x, node.output.sharding), {}
        case _:
            assert_never(node)


def call_kernel(layer: ir.Layer, x: jax.Array, weights: dict[str, jax.Array], rt: Runtime) -> tuple[jax.Array, Aux]:
    """Compute one layer with its kernel, called as `dslc.kernels.layers` prescribes: its
    output and its auxiliary values (`{}` unless the rule declares `has_aux`)."""
    rule = RULES[layer.kind]
    attrs = dict(layer.attrs)
    # An argument of type "input" holds the name of the declared input it reads.
    arrays: dict[str, jax.Array | None] = {arg: rt.inputs[name] for arg, name in input_args(rule, attrs).items()}
    if rule.random:
        arrays["key"] = rt.rng(layer.path) if rt.training else None
    shardings = {w.name: w.type.sharding for w in layer.weights}
    static = rule.kernel_args(attrs, jnp.dtype(rt.compute_dtype).name, layer.operand, shardings)
    out = getattr(kernels, rule.kernel(attrs, layer.operand))(x, **weights, **arrays, **static)
    return out if rule.has_aux else (out, {})  # type: ignore[no-any-return]


def _remat(
    block: ir.Block, body: Callable[[jax.Array, Params], tuple[jax.Array, Aux]]
) -> Callable[[jax.Array, Params], tuple[jax.Array, Aux]]:
    """Activation checkpointing of one block, as the spec declared it."""
    match block.remat.policy:
        case "none":
            return body
        case "full":
            return jax.checkpoint(body)
        case "selective":
            prefix = block.path + "."
            names = [
                n.path
                for n in ir.walk(block.body)
                if n.path[len(prefix) :] in block.remat.saved or n.path.rsplit(".", 1)[-1] in block.remat.saved
            ]
            return jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names(*names))
        case other:
            assert_never(other)


def split_loss(program: ir.Program) -> tuple[tuple[ir.Node, ...], ir.Layer | None]:
    """The model's body and its loss layer (the last node, when it is one)."""
    nodes = tuple(n for chunk in program.chunks for n in chunk.nodes)
    if nodes and isinstance(nodes[-1], ir.Layer) and nodes[-1].kind in LOSS_KINDS:
        return nodes[:-1], nodes[-1]
    return nodes, None


def run_forward(
    program: ir.Program, params: Params, inputs: dict[str, jax.Array], rt: Runtime
) -> tuple[jax.Array, Aux]:
    """The model's output before its loss, and the auxiliary values its layers returned."""
    body, _ = split_loss(program)
    return forward_nodes(body, inputs[program.stream], params, rt)


def run_loss(program: ir.Program, params: Params, batch: dict[str, jax.Array], rt: Runtime) -> jax.Array:
    """The loss layer's value plus the layers' auxiliary losses (`aux[AUX_LOSS]`), if any."""
    body, loss = split_loss(program)
    assert loss is not None, "run_loss needs a spec that ends in a loss"
    y, aux = forward_nodes(body, batch[program.stream], params, rt)
    value, _ = call_kernel(loss, y, {}, rt)
    return value + aux[kernels.AUX_LOSS] if kernels.AUX_LOSS in aux else value


def loss_count(program: ir.Program) -> Callable[[dict[str, jax.Array]], jax.Array] | None:
    """How many positions the loss averages over in a batch, as its rule counts them (None
    when every position counts alike): gradient accumulation weighs slices by it."""
    _, loss = split_loss(program)
    rule = RULES[loss.kind] if loss is not None else None
    if loss is None or rule is None or rule.count_kernel is None:
        return None
    attrs = dict(loss.attrs)
    inputs = input_args(rule, attrs)
    static = rule.kernel_args(attrs, "float32", loss.operand, {})
    count = getattr(kernels, rule.count_kernel)

    def counted(batch: dict[str, jax.Array]) -> jax.Array:
        return count(**{arg: batch[name] for arg, name in inputs.items()}, **static)  # type: ignore[no-any-return]

    return counted
