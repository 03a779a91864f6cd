"""One executor for every pipeline schedule: it runs the schedule's table, tick by tick.

The stage axis is manual (`shard_map` over it alone); data and tensor axes stay automatic
inside, so each stage is still split the way the spec says. Every tick, each stage looks up
its action in the table and does it with one `lax.switch`: idle, forward (F), backward (B),
or the backward's input-gradient (I) and weight-gradient (W) halves. A backward is an
explicit `jax.vjp` of the chunk, recomputed from the chunk's stashed input, so work happens
exactly where the table puts it and a stage holds only the activations the table keeps in
flight. After the switch, every stage sends unconditionally — activations to the next stage,
gradients to the previous one — so no collective over the stage axis ever sits inside a
branch (a `ppermute` that only some stages reach pairs the wrong ticks).

The table has one row per tick and one column per stage, with these entries:
  op                  what to do: IDLE, FORWARD, BACKWARD, INPUT_GRAD or WEIGHT_GRAD
  microbatch, chunk   what to do it on
  stash_slot          F writes the chunk's input here; B / I / W read it back
  activation_slot     F reads the activation it received here (every chunk but the first)
  gradient_slot       B / I / W read the output gradient they received here (all but the last)
  receive_activation  after the tick, store the activation arriving from the previous stage
                      here (-1: nothing arrives)
  receive_gradient    likewise for the gradient arriving from the next stage

Parameters are passed whole to every stage (replicated over the stage axis); each stage
only reads and differentiates its own chunks'.

Chunks may return an auxiliary loss besides their output (`has_aux`: a mixture of experts'
load-balancing loss). It is part of the objective: the chunk's backward differentiates
(output, aux) with cotangents (output gradient, 1/M), and the aux of every (microbatch,
chunk) is added, divided by M, to the loss where its backward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

IDLE, FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2, 3, 4

TABLE_ENTRIES = (
    "op",
    "microbatch",
    "chunk",
    "stash_slot",
    "activation_slot",
    "gradient_slot",
    "receive_activation",
    "receive_gradient",
)

# chunk(weights, x, inputs, key) -> the chunk's output; the last chunk returns its f32 loss.
# With `has_aux`, every chunk returns (that, aux), aux an f32 scalar added to the loss.
# `inputs` holds the microbatch of every model input; `key` is None when not training.
Chunk = Callable[[Any, jax.Array, dict[str, jax.Array], jax.Array | None], Any]


def pipeline_value_and_grad(
    chunks: Sequence[Chunk],
    weights: Sequence[Any],
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    *,
    table: dict[str, Any],
    mesh: jax.sharding.Mesh,
    axis: str,
    stream: str,
    microbatches: int,
    chunk_inputs: Sequence[tuple[int, ...]],
    boundary: tuple[tuple[int, ...], Any],
    has_aux: bool = False,
) -> tuple[jax.Array, list[Any]]:
    """Mean loss over the microbatches and the gradient of each chunk's weights.

    `chunk_inputs[c]` is the shape of one microbatch of chunk c's input; `boundary` is the
    (shape, dtype) of the buffer every inter-stage tensor is padded into: stages of one model
    may hand over tensors of different widths, and they share a buffer padded to the widest.
    """
    M = microbatches
    # Microbatch i takes rows i, i+M, i+2M, ...: each keeps rows from every data shard.
    micro = {k: v.reshape(v.shape[0] // M, M, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}
    tables = {name: jnp.asarray(np.asarray(table[name], np.int32)) for name in TABLE_ENTRIES}
    ops = sorted({int(code) for row in table["op"] for code in row} | {IDLE})
    op_index = jnp.asarray([[ops.index(int(code)) for code in row] for row in table["op"]], jnp.int32)
    slots = {name: max(1, int(np.max(table[name])) + 1) for name in ("stash_slot", "activation_slot", "gradient_slot")}
    training = key is not None

    def replicated(tree: Any) -> Any:
        return jax.tree.map(lambda _: PartitionSpec(), tree)

    def body(weights: list[Any], micro: Any, tables: Any, op_index: jax.Array, key: jax.Array) -> Any:
        return _run_table(
            chunks,
            weights,
            micro,
            tables,
            op_index,
            key if training else None,
            ops=ops,
            slots=slots,
            axis=axis,
            stream=stream,
            chunk_inputs=chunk_inputs,
            boundary=boundary,
            has_aux=has_aux,
        )

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(replicated(list(weights)), replicated(micro), replicated(tables), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), replicated(list(weights))),
        axis_names={axis},
    )
    return run(list(weights), micro, tables, op_index, key if key is not None else jax.random.key(0))  # type: ignore[no-any-return]


def _run_table(
    chunks: Sequence[Chunk],
    weights: list[Any],
    micro: dict[str, jax.Array],
    tables: dict[str, jax.Array],
    op_index: jax.Array,
    key: jax.Array | None,
    *,
    ops: list[int],
    slots: dict[str, int],
    axis: str,
    stream: str,
    chunk_inputs: Sequence[tuple[int, ...]],
    boundary: tuple[tuple[int, ...], Any],
    has_aux: bool,
) -> tuple[jax.Array, list[Any]]:
    """The body on one stage: scan over the ticks of the table."""
    C = len(chunks)
    M = micro[stream].shape[0]
    P = lax.axis_size(axis)
    s = lax.axis_index(axis)
    shape, dtype = boundary

    def vary(tree: Any) -> Any:
        """Mark values as differing between stages (the carry of the tick loop must be)."""

        def one(x: jax.Array) -> jax.Array:
            x = jnp.asarray(x)
            return x if axis in jax.typeof(x).mat.varying else lax.pcast(x, (axis,), to="varying")

        return jax.tree.map(one, tree)

    def fit(y: jax.Array) -> jax.Array:
        """Pad a chunk's output into the shared boundary buffer."""
        return jnp.pad(y.astype(dtype), [(0, full - have) for full, have in zip(shape, y.shape, strict=True)])

    def take(buffer: jax.Array, c: int) -> jax.Array:
        """Chunk c's own input out of the shared buffer."""
        return buffer[tuple(slice(0, n) for n in chunk_inputs[c])]

    def scalar_like(t: jax.Array, value: float) -> jax.Array:
        """`value` typed as `t` is, varying over the stages or not (a cotangent must be)."""
        c = jnp.asarray(value, t.dtype)
        return vary(c) if axis in jax.typeof(t).mat.varying else c

    stash = vary(jnp.zeros((slots["stash_slot"], *shape), dtype))
    # Chunk 0's inputs are the model's own input (token ids, say), kept apart from the buffer.
    first_stash = vary(jnp.zeros((slots["stash_slot"], *micro[stream].shape[1:]), micro[stream].dtype))
    acts = vary(jnp.zeros((slots["activation_slot"], *shape), dtype))
    grads_in = vary(jnp.zeros((slots["gradient_slot"], *shape), dtype))
    gacc = vary(jax.tree.map(jnp.zeros_like, weights))
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
        mb_key = jax.random.fold_in(key, m) if key is not None else None

        def call(i: int, w: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            """Chunk i's output (its loss, for the last) and its auxiliary loss."""
            out = chunks[i](w, x, inputs, mb_key)
            return out if has_aux else (out, jnp.zeros((), jnp.float32))

        def per_chunk(make: Callable[[int], Callable[[], tuple[Any, ...]]]) -> tuple[Any, ...]:
            return vary(lax.switch(c, [make(i) for i in range(C)]))

        def own(i: int) -> Any:
            # Varying over the stage axis before differentiating: the transpose of an
            # implicit invariant-to-varying cast is a psum over stages, which inside a
            # branch only some stages take would deadlock.
            return vary(weights[i])

        def add_grads(i: int, g: Any) -> list[Any]:
            return [jax.tree.map(jnp.add, acc, g) if j == i else acc for j, acc in enumerate(gacc)]

        def idle() -> tuple[Any, ...]:
            return vary((stash, first_stash, gacc, loss, zero, zero))

        def forward() -> tuple[Any, ...]:
            def make(i: int) -> Callable[[], tuple[Any, ...]]:
                def go() -> tuple[Any, ...]:
                    if i == 0:
                        x = inputs[stream]
                        new_first, new_stash = first_stash.at[slot].set(x), stash
                    else:
                        x = take(acts[a_slot], i)
                        new_first, new_stash = first_stash, stash.at[slot].set(fit(x))
                    # The last chunk's forward only keeps its input: its backward recomputes
                    # it together with the loss.
                    y = zero if i == C - 1 else fit(call(i, own(i), x)[0])
                    return new_stash, new_first, y

                return go

            new_stash, new_first, y = per_chunk(make)
            return vary((new_stash, new_first, gacc, loss, y, zero))

        def backward(weight_grads: bool, input_grads: bool) -> Callable[[], tuple[Any, ...]]:
            def run() -> tuple[Any, ...]:
                def make(i: int) -> Callable[[], tuple[Any, ...]]:
                    def go() -> tuple[Any, ...]:
                        def f(w: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
                            return call(i, w, x)

                        # The loss's gradient is d(mean over microbatches)/d(loss_m), and so is
                        # an auxiliary loss's; any other chunk's output gradient arrived shaped
                        # as the next chunk's input.
                        dy = jnp.asarray(1.0 / M, jnp.float32) if i == C - 1 else take(grads_in[g_slot], i + 1)
                        if i == 0:  # token ids: no gradient flows further back
                            (value, aux), pull = jax.vjp(lambda w: f(w, first_stash[slot]), own(i))
                            (dw,), dx = pull((vary(dy.astype(value.dtype)), scalar_like(aux, 1.0 / M))), zero
                        else:
                            (value, aux), pull = jax.vjp(f, own(i), take(stash[slot], i))
                            dw, dx = pull((vary(dy.astype(value.dtype)), scalar_like(aux, 1.0 / M)))
                            dx = fit(dx)
                        new_gacc = add_grads(i, dw) if weight_grads else gacc
                        # Counted once per microbatch and chunk: by B, or by I when B is split.
                        counted = aux + value if i == C - 1 else aux
                        new_loss = loss + counted / M if input_grads else loss
                        return new_gacc, new_loss, dx if input_grads else zero

                    return go

                new_gacc, new_loss, dx = per_chunk(make)
                return vary((stash, first_stash, new_gacc, new_loss, zero, dx))

            return run

        # Only the ops this table uses are compiled (GPipe and 1F1B never split B).
        every = {
            IDLE: idle,
            FORWARD: forward,
            BACKWARD: backward(True, True),
            INPUT_GRAD: backward(False, True),
            WEIGHT_GRAD: backward(True, False),
        }
        stash, first_stash, gacc, loss, send_act, send_grad = lax.switch(op_index[t, s], [every[code] for code in ops])
        # Unconditional ring sends: every stage, every tick, outside the switch.
        got_act = lax.ppermute(send_act, axis, [(i, (i + 1) % P) for i in range(P)])
        got_grad = lax.ppermute(send_grad, axis, [(i, (i - 1) % P) for i in range(P)])
        ra, rg = tables["receive_activation"][t, s], tables["receive_gradient"][t, s]
        acts = jnp.where(ra >= 0, acts.at[jnp.maximum(ra, 0)].set(got_act), acts)
        grads_in = jnp.where(rg >= 0, grads_in.at[jnp.maximum(rg, 0)].set(got_grad), grads_in)
        return vary((stash, first_stash, acts, grads_in, gacc, loss)), None

    carry = (stash, first_stash, acts, grads_in, gacc, loss)
    (_, _, _, _, gacc, loss), _ = lax.scan(tick, carry, jnp.arange(tables["op"].shape[0]))
    # Each stage holds the gradients of its own chunks (zeros elsewhere) and the loss of the
    # microbatches that ended on it: the sums over stages are the whole.
    return lax.psum(loss, axis), jax.tree.map(lambda g: lax.psum(g, axis), gacc)
