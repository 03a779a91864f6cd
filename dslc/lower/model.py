"""The model as Flax NNX state, and the interpreter that runs the checked IR on it.

Parameters live in one `nnx.Dict` keyed by their stable dotted names (`blocks.3.attn.q`),
each an `nnx.Param` created directly with its declared sharding. The forward pass walks the
IR: each layer is computed by its own rule (`LayerRule.apply`) and its output pinned to the
sharding the checker gave it, so the collectives XLA inserts are the ones the IR predicts.
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
from dslc.kernels.params import initial_value, named_key
from dslc.layers import LOSS_KINDS, RULES
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


def forward_nodes(nodes: tuple[ir.Node, ...], x: jax.Array, params: Params, rt: Runtime) -> jax.Array:
    for run in group_repeats(nodes):
        x = _run(run[0], x, params, rt) if len(run) == 1 else _scan(run, x, params, rt)
    return x


def _scan(run: tuple[ir.Node, ...], x: jax.Array, params: Params, rt: Runtime) -> jax.Array:
    """A run of identical blocks as one `lax.scan` over their stacked weights.

    One loop body instead of N copies keeps compile time flat in depth, and it is what
    makes activation checkpointing save memory: the loop keeps only each block's input,
    and the checkpointed body recomputes the rest during the backward pass.
    """
    first = run[0]
    assert isinstance(first, ir.Block)
    names = [f"{layer.path}.{w.name}" for layer in ir.layers(first.body) for w in layer.weights]
    suffixes = [name[len(first.path) :] for name in names]
    stacked = {s: jnp.stack([params[block.path + s] for block in run]) for s in suffixes}
    base_key = rt.dropout_key

    def body(h: jax.Array, step: tuple[jax.Array, dict[str, jax.Array]]) -> tuple[jax.Array, None]:
        index, weights = step
        if base_key is not None:
            rt.dropout_key = jax.random.fold_in(base_key, index)
        local = {first.path + s: w for s, w in weights.items()}
        return _run(first, h, local, rt), None

    y, _ = jax.lax.scan(body, x, (jnp.arange(len(run)), stacked))
    rt.dropout_key = base_key
    return y


def _run(node: ir.Node, x: jax.Array, params: Params, rt: Runtime) -> jax.Array:
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
            y = call_kernel(node, x, weights, rt)
            if node.output.rank:
                y = rt.constrain(y, node.output.sharding)
            return rt.name(y, node.path)
        case ir.Residual():
            return x + forward_nodes(node.body, x, params, rt)
        case ir.Block():
            body: Callable[[jax.Array, Params], jax.Array] = lambda h, p: forward_nodes(node.body, h, p, rt)  # noqa: E731
            return _remat(node, body)(x, params)
        case ir.Layout():
            return rt.constrain(x, node.output.sharding)
        case _:
            assert_never(node)


def call_kernel(layer: ir.Layer, x: jax.Array, weights: dict[str, jax.Array], rt: Runtime) -> jax.Array:
    """Compute one layer with its kernel, called as `dslc.kernels.layers` prescribes."""
    rule = RULES[layer.kind]
    attrs = dict(layer.attrs)
    arrays: dict[str, jax.Array | None] = {
        arg.name: rt.inputs[attrs[arg.name]] for arg in rule.args if arg.type == "input"
    }  # type: ignore[index]
    if rule.random:
        arrays["key"] = rt.rng(layer.path) if rt.training else None
    static = rule.kernel_args(attrs, jnp.dtype(rt.compute_dtype).name, layer.operand)
    return getattr(kernels, rule.kernel)(x, **weights, **arrays, **static)  # type: ignore[no-any-return]


def _remat(block: ir.Block, body: Callable[[jax.Array, Params], jax.Array]) -> Callable[[jax.Array, Params], jax.Array]:
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


def run_forward(program: ir.Program, params: Params, inputs: dict[str, jax.Array], rt: Runtime) -> jax.Array:
    body, _ = split_loss(program)
    return forward_nodes(body, inputs[program.stream], params, rt)


def run_loss(program: ir.Program, params: Params, batch: dict[str, jax.Array], rt: Runtime) -> jax.Array:
    body, loss = split_loss(program)
    assert loss is not None, "run_loss needs a spec that ends in a loss"
    y = forward_nodes(body, batch[program.stream], params, rt)
    return call_kernel(loss, y, {}, rt)
