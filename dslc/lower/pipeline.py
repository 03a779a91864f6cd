"""One executor for every pipeline schedule: it runs the table, tick by tick.

The stage axis is manual (`shard_map` over it alone); data and tensor axes stay automatic
inside, so each stage is still split the way the spec says. Every tick, each stage looks up
its action in the schedule's table and does it with one `lax.switch`: idle, forward (F),
backward (B), or the backward's input-gradient (I) and weight-gradient (W) halves. A
backward is an explicit `jax.vjp` of the chunk, recomputed from the chunk's stashed input,
so work happens exactly where the table puts it and a stage holds only the activations the
table keeps in flight. After the switch, every stage sends unconditionally — activations to
the next stage, gradients to the previous one — so no collective over the stage axis ever
sits inside a branch (see the field notes: a divergent `ppermute` pairs the wrong ticks).

Parameters are passed whole to every stage (replicated over the stage axis); each stage only
reads and differentiates its own chunks'. Stage-local storage of weights is future work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from dslc.ir import nodes as ir
from dslc.layers import LOSS_KINDS
from dslc.lower.model import Params, call_kernel, forward_nodes
from dslc.lower.runtime import JNP_DTYPES, Runtime
from dslc.schedules import build
from dslc.schedules.buffers import BACKWARD, FORWARD, IDLE, INPUT_GRAD, WEIGHT_GRAD, ExecutionPlan, plan


class PipelineExecutor:
    """Loss and gradients of a pipelined program, by running its schedule's table."""

    def __init__(self, program: ir.Program, mesh: jax.sharding.Mesh, compute_dtype: Any) -> None:
        p = program.pipeline
        assert p is not None
        self.program = program
        self.mesh = mesh
        self.axis = p.axis
        self.stages = program.mesh.size((p.axis,))
        self.microbatches = p.microbatches
        self.compute_dtype = compute_dtype
        self.schedule = build(p.schedule, self.stages, p.microbatches, p.virtual)
        self.plan: ExecutionPlan = plan(self.schedule)
        self.ops = sorted({code for row in self.plan.op for code in row} | {IDLE})
        self.chunks = program.chunks
        last = self.chunks[-1].nodes
        assert last and isinstance(last[-1], ir.Layer) and last[-1].kind in LOSS_KINDS, "the checker guarantees a loss"
        self.loss_layer = last[-1]
        self.boundary = self._boundary_type()
        self.weights_of = [
            tuple(f"{layer.path}.{w.name}" for layer in ir.layers(chunk.nodes) for w in layer.weights)
            for chunk in self.chunks
        ]

    # ---- shapes ---------------------------------------------------------------------------------

    def _boundary_type(self) -> tuple[tuple[int, ...], Any]:
        """The buffer every inter-stage tensor fits in: one microbatch of the largest one.

        Stages of one model may hand over tensors of different widths (784 -> 512 -> 256);
        they share a buffer padded to the widest, and each chunk reads its own slice.
        """
        outs = [chunk.nodes[-1].output for chunk in self.chunks[:-1] if chunk.nodes]
        if not outs:
            return (1,), self.compute_dtype
        rank = outs[0].rank
        assert all(t.rank == rank for t in outs), "the checker keeps stage boundaries of one rank"
        shape = tuple(max(t.shape[i] for t in outs) for i in range(rank))
        return (shape[0] // self.microbatches, *shape[1:]), JNP_DTYPES[outs[0].dtype]

    def _fit(self, y: jax.Array) -> jax.Array:
        """Pad a chunk's output into the shared boundary buffer."""
        shape, dtype = self.boundary
        pad = [(0, full - have) for full, have in zip(shape, y.shape, strict=True)]
        return jnp.pad(y.astype(dtype), pad)

    def _take(self, buffer: jax.Array, t: ir.TensorType) -> jax.Array:
        """A chunk's own input out of the shared buffer."""
        local = (t.shape[0] // self.microbatches, *t.shape[1:])
        return buffer[tuple(slice(0, n) for n in local)]

    # ---- one chunk --------------------------------------------------------------------------------

    def _chunk_fn(
        self, c: int, inputs: dict[str, jax.Array], key: jax.Array | None
    ) -> Callable[[Params, jax.Array], jax.Array]:
        """Chunk c as a function of its weights and its input; the last one ends in the loss."""
        chunk = self.chunks[c]
        nodes = chunk.nodes[:-1] if c == len(self.chunks) - 1 else chunk.nodes

        def run(params: Params, x: jax.Array) -> jax.Array:
            rt = Runtime(
                self.mesh,
                self.compute_dtype,
                inputs,
                training=key is not None,
                dropout_key=key,
                manual_axes=(self.axis,),
            )
            y = forward_nodes(nodes, x, params, rt)
            if c == len(self.chunks) - 1:
                return call_kernel(self.loss_layer, y, {}, rt)
            return y

        return run

    # ---- the step -----------------------------------------------------------------------------------

    def value_and_grad(
        self, params: Params, batch: dict[str, jax.Array], key: jax.Array | None
    ) -> tuple[jax.Array, Params]:
        M = self.microbatches
        # Microbatch i takes rows i, i+M, i+2M, ...: each keeps rows from every data shard.
        micro = {k: v.reshape(v.shape[0] // M, M, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}
        tables = {
            name: jnp.asarray(getattr(self.plan, name), jnp.int32)
            for name in (
                "microbatch",
                "chunk",
                "stash_slot",
                "activation_slot",
                "gradient_slot",
                "receive_activation",
                "receive_gradient",
            )
        }
        tables["op_index"] = jnp.asarray([[self.ops.index(code) for code in row] for row in self.plan.op], jnp.int32)
        key_in = key if key is not None else jax.random.key(0)
        specs = (
            jax.tree.map(lambda _: PartitionSpec(), params),
            jax.tree.map(lambda _: PartitionSpec(), micro),
            jax.tree.map(lambda _: PartitionSpec(), tables),
            PartitionSpec(),
        )
        run = jax.shard_map(
            lambda p, b, t, k: self._body(p, b, t, k, training=key is not None),
            mesh=self.mesh,
            in_specs=specs,
            out_specs=(PartitionSpec(), jax.tree.map(lambda _: PartitionSpec(), params)),
            axis_names={self.axis},
        )
        return run(params, micro, tables, key_in)

    def _body(
        self, params: Params, micro: dict[str, jax.Array], tables: dict[str, jax.Array], key: jax.Array, training: bool
    ) -> tuple[jax.Array, Params]:
        axis, P, C, M = self.axis, self.stages, len(self.chunks), self.microbatches
        s = lax.axis_index(axis)
        shape, dtype = self.boundary

        def vary(a: Any) -> Any:
            def one(x: jax.Array) -> jax.Array:
                x = jnp.asarray(x)
                return x if axis in jax.typeof(x).mat.varying else lax.pcast(x, (axis,), to="varying")

            return jax.tree.map(one, a)

        stash = vary(jnp.zeros((max(self.plan.stash_slots, 1), *shape), dtype))
        first_stash = vary(
            jnp.zeros(
                (max(self.plan.stash_slots, 1), *micro[self.program.stream].shape[1:]), micro[self.program.stream].dtype
            )
        )
        acts = vary(jnp.zeros((max(self.plan.activation_slots, 1), *shape), dtype))
        grads_in = vary(jnp.zeros((max(self.plan.gradient_slots, 1), *shape), dtype))
        gacc = vary(jax.tree.map(jnp.zeros_like, params))
        loss = vary(jnp.zeros((), jnp.float32))
        zero = vary(jnp.zeros(shape, dtype))

        def tick(carry: tuple[Any, ...], t: jax.Array) -> tuple[tuple[Any, ...], None]:
            stash, first_stash, acts, grads_in, gacc, loss = carry
            m, c = tables["microbatch"][t, s], tables["chunk"][t, s]
            slot, a_slot, g_slot = (
                tables["stash_slot"][t, s],
                tables["activation_slot"][t, s],
                tables["gradient_slot"][t, s],
            )
            inputs = {k: v[m] for k, v in micro.items()}
            mb_key = jax.random.fold_in(key, m) if training else None

            def chunk_branches(make: Callable[[int], Callable[[], tuple[Any, ...]]]) -> tuple[Any, ...]:
                return vary(lax.switch(c, [make(i) for i in range(C)]))

            def x_of(i: int) -> jax.Array:
                if i == 0:
                    return first_stash[slot]
                return self._take(stash[slot], self.chunks[i].nodes[0].input)

            def dy_of(i: int) -> jax.Array:
                if i == C - 1:
                    return jnp.asarray(1.0 / M, jnp.float32)  # d(mean over microbatches)/d(loss_m)
                return self._take(grads_in[g_slot], self.chunks[i].nodes[-1].output)

            def own(i: int) -> Params:
                # Varying over the stage axis before differentiating: the transpose of an
                # implicit invariant-to-varying cast is a psum over stages, which inside a
                # branch only some stages take would deadlock.
                return vary({n: params[n] for n in self.weights_of[i]})

            def add_grads(acc: Params, g: Params) -> Params:
                return {n: acc[n] + g[n] if n in g else acc[n] for n in acc}

            def idle() -> tuple[Any, ...]:
                return vary((stash, first_stash, gacc, loss, zero, zero))

            def forward() -> tuple[Any, ...]:
                def make(i: int) -> Callable[[], tuple[Any, ...]]:
                    def go() -> tuple[Any, ...]:
                        if i == 0:
                            x = inputs[self.program.stream]
                            new_first, new_stash = first_stash.at[slot].set(x), stash
                        else:
                            x = self._take(acts[a_slot], self.chunks[i].nodes[0].input)
                            new_first, new_stash = first_stash, stash.at[slot].set(self._fit(x))
                        # The last chunk's forward only keeps its input: its backward
                        # recomputes it together with the loss.
                        y = zero if i == C - 1 else self._fit(self._chunk_fn(i, inputs, mb_key)(own(i), x))
                        return new_stash, new_first, y

                    return go

                new_stash, new_first, y = chunk_branches(make)
                return vary((new_stash, new_first, gacc, loss, y, zero))

            def backward(weights: bool, inputs_grad: bool) -> Callable[[], tuple[Any, ...]]:
                def run() -> tuple[Any, ...]:
                    def make(i: int) -> Callable[[], tuple[Any, ...]]:
                        def go() -> tuple[Any, ...]:
                            f = self._chunk_fn(i, inputs, mb_key)
                            x, dy = x_of(i), dy_of(i)
                            if i == 0:  # token ids: no gradient flows further back
                                value, pull = jax.vjp(lambda p: f(p, x), own(i))
                                (dp,), dx = pull(vary(dy.astype(value.dtype))), zero
                            else:
                                value, pull = jax.vjp(f, own(i), x)
                                dp, dx = pull(vary(dy.astype(value.dtype)))
                                dx = self._fit(dx)
                            new_gacc = add_grads(gacc, dp) if weights else gacc
                            counted = value if i == C - 1 and inputs_grad else jnp.zeros((), jnp.float32)
                            return new_gacc, loss + counted / M, dx if inputs_grad else zero

                        return go

                    new_gacc, new_loss, dx = chunk_branches(make)
                    return vary((stash, first_stash, new_gacc, new_loss, zero, dx))

                return run

            # Only the ops this schedule uses are compiled (GPipe and 1F1B never split B).
            every = {
                IDLE: idle,
                FORWARD: forward,
                BACKWARD: backward(True, True),
                INPUT_GRAD: backward(False, True),
                WEIGHT_GRAD: backward(True, False),
            }
            branches = [every[code] for code in self.ops]
            stash, first_stash, gacc, loss, send_act, send_grad = lax.switch(tables["op_index"][t, s], branches)
            # Unconditional ring sends: every stage, every tick, outside the switch.
            got_act = lax.ppermute(send_act, axis, [(i, (i + 1) % P) for i in range(P)])
            got_grad = lax.ppermute(send_grad, axis, [(i, (i - 1) % P) for i in range(P)])
            ra, rg = tables["receive_activation"][t, s], tables["receive_gradient"][t, s]
            acts = jnp.where(ra >= 0, acts.at[jnp.maximum(ra, 0)].set(got_act), acts)
            grads_in = jnp.where(rg >= 0, grads_in.at[jnp.maximum(rg, 0)].set(got_grad), grads_in)
            return vary((stash, first_stash, acts, grads_in, gacc, loss)), None

        carry = (stash, first_stash, acts, grads_in, gacc, loss)
        (_, _, _, _, gacc, loss), _ = lax.scan(tick, carry, jnp.arange(self.plan.ticks))
        # Each stage holds the gradients of its own chunks (zeros elsewhere) and the loss of
        # the microbatches that ended on it: the sums over stages are the whole.
        return lax.psum(loss, axis), jax.tree.map(lambda g: lax.psum(g, axis), gacc)
