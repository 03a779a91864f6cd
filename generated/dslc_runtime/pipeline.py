"""One executor for every pipeline schedule: it runs the schedule's table, tick by tick.

The stage axis is manual (`shard_map` over it); tensor axes stay automatic inside, so each
stage is still split the way the spec says, and so do data axes the step does not run
data-parallel by hand (see "Data parallelism" below). Each stage holds only its own
weights: the stored arrays come in split over the stage axis (`stage_dims`), and a chunk
reads its share of the stage's piece (`shares`). A weight kept whole between steps but split
over the stage axis (an embedding, a head) is gathered for every stage on the way in, and its
gradient reduce-scattered back on the way out.

Every tick, each stage looks up its action in the table:

* F runs a chunk forward with `jax.vjp` and keeps what its backward needs — the residuals
  autodiff saves, which the spec's checkpointing decides — in the stash slot the table names.
  Weights are not stashed: the backward reads them again.
* B (or its halves I and W) rebuilds the chunk's backward from the stash and the weights and
  pulls the output gradient through it; W adds the weight gradients to the stage's
  accumulator, B and I send the input gradient back.

A tick runs two `lax.switch`es, forward then backward, each with a branch 0 that does
nothing. The branches take and return one microbatch's values and the weight gradients of
the chunk they ran; the stash, the received activations and gradients, and the gradient
accumulator are read and written outside them — in slots the table gives (a scratch slot
when there is nothing to keep), the accumulator by one add — so the loop's buffers are never
copied through a conditional (XLA before jaxlib 0.11.1 copies every buffer a conditional
returns unchanged from a branch other than its first). After the switches every stage sends —
activations to the next stage, gradients to the previous one, as one buffer (`send`) — at
every tick where some stage receives; the decision is the tick's, the same on every stage, so
no collective over the stage axis ever sits inside a branch some stages skip. Within a
branch, collectives may run only among one stage's devices (a tensor-parallel all-reduce,
ZeRO-3's gather over the data axes) and never as a collective-permute, which XLA runs as
one exchange among every device it names, whichever stage holds them (`take_share` gathers
before it slices for that reason; `dslc.lower.hlo.stalling` finds any that remain). Nothing
that is the same every tick is computed in the loop (each microbatch's dropout key is made
before it).

The table has one row per tick and one column per stage, with these entries:
  op                  what to do: IDLE, FORWARD, BACKWARD, INPUT_GRAD or WEIGHT_GRAD
  microbatch, chunk   what to do it on
  stash_slot          F writes the chunk's input and residuals here; B / I / W read them
  activation_slot     F reads the activation it received here (every chunk but the first)
  gradient_slot       B / I / W read the output gradient they received here (all but the last)
  receive_activation  after the tick, store the activation arriving from the previous stage
                      here (-1: nothing arrives)
  receive_gradient    likewise for the gradient arriving from the next stage

A placement that is not a ring (a V: stage d holds chunks d and 2P-1-d) also passes values
the other way and keeps some on the stage that made them; its table then has, likewise,
  activation_from_next, gradient_from_previous    arrivals from the other neighbour
  keep_activation, keep_gradient                  what the stage made for its own next chunk
and every tick sends its value both ways round the ring: each arrival has one receiver.

Chunks may return an auxiliary loss besides their output (`has_aux`: a mixture of experts'
load-balancing loss). It is part of the objective: the chunk's backward differentiates
(output, aux) with cotangents (output gradient, 1/M), and its value, divided by M, joins the
loss in the forward tick.

Data parallelism: the executor runs on the batch it is given. A training step runs it inside
`data_parallel`'s own `shard_map`, manual over the batch's data axes: the batch is then this
device's rows, every microbatch and buffer a slice of them, and the gradients the backward
ticks add up are partial sums over the data axes, which `data_parallel` reduces once, after
the last tick. Inside the tick loop nothing goes over the data axes; were they automatic,
XLA's partitioner would all-reduce every microbatch's weight gradients within its tick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .schedule import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD
from .storage import Parameter, axes_of

# The name scope of the switches whose branch each stage picks for itself: a collective in
# them may only run within a stage (`dslc.lower.hlo.stalling`).
STAGE_BRANCHES = "stage_branches"

# chunk(weights, x, inputs, key) -> the chunk's output; the last chunk returns its f32 loss.
# With `has_aux`, every chunk returns (that, aux), aux an f32 scalar added to the loss.
# `inputs` holds the microbatch of every model input; `key` is None when not training.
Chunk = Callable[[Any, jax.Array, dict[str, jax.Array], jax.Array | None], Any]
# weights(stage_arrays) -> a chunk's weights, as its code computes with them.
ChunkWeights = Callable[[dict[str, jax.Array]], dict[str, jax.Array]]


class PipelineRun(NamedTuple):
    """What the executor runs: the schedule's `table` (`schedule_tables`), over the mesh axis
    `axis`, on a batch cut into `microbatches`; `stream` is the input the first chunk reads.
    `chunk_inputs[c]` is the shape of one microbatch of chunk c's input, `boundary` the
    (shape, dtype) of the buffer every inter-stage tensor is padded into."""

    table: dict[str, Any]
    axis: str
    stream: str
    microbatches: int
    chunk_inputs: Sequence[tuple[int, ...]]
    boundary: tuple[tuple[int, ...], Any]


def pipeline_value_and_grad(
    chunks: Sequence[Chunk],
    shares: Sequence[ChunkWeights],
    params: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    *,
    mesh: jax.sharding.Mesh,
    pipeline: PipelineRun,
    parameters: dict[str, Parameter],
    has_aux: bool = False,
    count: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
    grad_dtype: str | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean loss over the microbatches and the gradient of every stored array, summed over
    the microbatches in `grad_dtype` when given (f32 beside 16-bit parameters).

    Each stored array comes in as `parameters` places it under the pipeline: its
    `stage_rows` is the dimension whose pieces are each stage's own (rows or layers), or its
    `stage_split` the dimension a whole array is split along over the stage axis between
    steps (both None: every stage holds all of it). `count`, for a loss that averages over
    the positions it counts (cross-entropy's ignored targets), gives their number in a batch:
    each microbatch's loss then weighs by its share of the batch's, so the result is the
    batch's mean over its counted positions rather than a mean of microbatch means.
    """
    M, axis, table = pipeline.microbatches, pipeline.axis, pipeline.table
    stage_dims = {name: (p.stage_rows, p.stage_split) for name, p in parameters.items()}
    # Microbatch i takes rows i, i+M, i+2M, ...: each keeps rows from every data shard.
    micro = {k: v.reshape(v.shape[0] // M, M, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}
    # Under data parallelism (`data_parallel`) the batch is this device's rows, and so is
    # every microbatch the buffers hold (their first dimension).
    rows = batch[pipeline.stream].shape[0] // M
    local_pipeline = pipeline._replace(
        chunk_inputs=[(rows, *shape[1:]) for shape in pipeline.chunk_inputs],
        boundary=((rows, *pipeline.boundary[0][1:]), pipeline.boundary[1]),
    )
    tables = {name: jnp.asarray(np.asarray(rows, np.int32)) for name, rows in table.items()}

    def along(dim: int | None) -> PartitionSpec:
        return PartitionSpec() if dim is None else PartitionSpec(*(None,) * dim, axis)

    in_specs = {name: along(own) for name, (own, _) in stage_dims.items()}
    out_specs = {name: along(own if own is not None else split) for name, (own, split) in stage_dims.items()}

    # Each microbatch's weight in the mean loss: 1/M, or its share of the counted positions.
    if count is None:
        weights = jnp.full((M,), 1.0 / M, jnp.float32)
    else:
        counts = jax.vmap(count)(micro).astype(jnp.float32)
        weights = counts / jnp.maximum(counts.sum(), 1.0)

    def body(
        local: dict[str, jax.Array], micro: dict[str, jax.Array], tables: Any, key: jax.Array, weights: jax.Array
    ) -> Any:
        executor = _Executor(
            chunks,
            shares,
            has_aux,
            local_pipeline,
            local,
            micro,
            tables,
            key if key_given else None,
            weights,
            grad_dtype,
        )
        loss, gacc = executor.run()
        grads = {}
        for name, g in gacc.items():
            own, split = stage_dims[name]
            if own is not None:
                grads[name] = g
                continue
            # XLA's CPU backend aborts widening a 16-bit sum in a partly manual map (it would
            # widen it anyway): there the sum runs in f32 and is narrowed back.
            wide = g.astype(jnp.float32) if cpu and jnp.finfo(g.dtype).bits < 32 else g
            if split is not None:
                # Only the stages that use it hold a gradient; each keeps its piece of the sum.
                wide = lax.psum_scatter(wide, axis, scatter_dimension=split, tiled=True)
            else:
                wide = lax.psum(wide, axis)
            grads[name] = wide.astype(g.dtype)
        return lax.psum(loss, axis), grads

    cpu = jax.default_backend() == "cpu"

    key_given = key is not None
    # Inside data parallelism's own `shard_map` (`data_parallel`), the mesh in context has its
    # data axes manual already, and a nested map must say so.
    context = jax.sharding.get_abstract_mesh()
    run = jax.shard_map(
        body,
        mesh=context if context.manual_axes else mesh,
        in_specs=(in_specs, PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec(), out_specs),
        axis_names={axis},
        # Nothing differentiates through this map: every gradient is taken inside, by the
        # explicit backward ticks, so replication needs no tracking here.
        check_vma=False,
    )
    return run(params, micro, tables, key if key is not None else jax.random.key(0), weights)


class _Executor:
    """The loop on one stage: its buffers, the two switches of a tick, and the sends."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        shares: Sequence[ChunkWeights],
        has_aux: bool,
        pipeline: PipelineRun,
        local: dict[str, jax.Array],
        micro: dict[str, jax.Array],
        tables: dict[str, jax.Array],
        key: jax.Array | None,
        loss_weights: jax.Array,
        grad_dtype: str | None = None,
    ) -> None:
        """`pipeline` as one stage sees it (its microbatches' rows), `local` the stage's pieces
        of the stored arrays, `micro` the microbatches, `tables` the schedule's tables as
        arrays, `loss_weights` each microbatch's weight in the mean loss, `grad_dtype` the
        accumulator's (None: the arrays' own)."""
        self.grad_dtype = grad_dtype
        self.chunks, self.shares, self.has_aux, self.local, self.micro = chunks, shares, has_aux, local, micro
        self.tables, self.key, self.loss_weights = tables, key, loss_weights
        self.axis, self.stream, self.M = pipeline.axis, pipeline.stream, pipeline.microbatches
        self.chunk_inputs, (self.shape, self.dtype) = pipeline.chunk_inputs, pipeline.boundary
        # Each microbatch's dropout key, made once rather than hashed again every tick.
        self.keys = None if key is None else jax.vmap(lambda m: jax.random.fold_in(key, m))(jnp.arange(self.M))
        self.C = len(chunks)
        self.used = sorted({int(code) for row in pipeline.table["op"] for code in row})
        # Each buffer has one slot more than the table uses: the scratch slot that ticks with
        # nothing to keep write to, so every write is unconditional.
        self.slots = {
            name: int(np.max(pipeline.table[name])) + 1 for name in ("stash_slot", "activation_slot", "gradient_slot")
        }
        self.scratch = dict(self.slots)
        # The ticks after which some stage keeps what a neighbour sent: the others send nothing.
        arrivals = ("receive_activation", "receive_gradient", "activation_from_next", "gradient_from_previous")
        self.arrives = np.any(
            [np.asarray(pipeline.table[name]) >= 0 for name in arrivals if name in pipeline.table], axis=(0, 2)
        )
        self.residual_layout = self._residual_layout()
        # What F records for B while tracing: how to rebuild each chunk's backward.
        self.rebuild: dict[int, tuple[Any, list[tuple[str, Any]], Any]] = {}

    # ---- what a chunk computes --------------------------------------------------------------

    def weights(self, c: int) -> dict[str, jax.Array]:
        return self.shares[c](self.local)

    def call(self, c: int, w: Any, x: jax.Array, inputs: dict[str, jax.Array], key: jax.Array | None) -> Any:
        out = self.chunks[c](w, x, inputs, key)
        return out if self.has_aux else (out, jnp.zeros((), jnp.float32))

    def forward_vjp(self, c: int, inputs: dict[str, jax.Array], x: jax.Array, key: jax.Array | None) -> Any:
        """The chunk's (output, aux) and its backward; the first chunk's input (token ids)
        takes no gradient."""
        w = self.weights(c)
        if c == 0:
            out, pull = jax.vjp(lambda w: self.call(c, w, inputs[self.stream], inputs, key), w)
            return out, pull, (w,)
        out, pull = jax.vjp(lambda w, x: self.call(c, w, x, inputs, key), w, x)
        return out, pull, (w, x)

    def _residual_layout(self) -> tuple[list[tuple[tuple[int, ...], Any]], list[list[int]]]:
        """The stash every stage keeps per slot, and which buffer each chunk's residuals go to.

        All stages run one program, so the stash holds buffers for every chunk's residuals.
        Chunks share a buffer for residuals of one shape and dtype (uniform chunks share all
        of them); residuals of other shapes get buffers of their own rather than padding, as
        padding or slicing a dimension split over the mesh moves data between devices."""
        buffers: list[tuple[tuple[int, ...], Any]] = []
        placement: list[list[int]] = []
        for c in range(self.C):
            inputs = {k: v[0] for k, v in self.micro.items()}
            x = jnp.zeros(self.chunk_inputs[c], self.dtype)

            def saved(c: int = c, inputs: dict[str, jax.Array] = inputs, x: jax.Array = x) -> list[jax.Array]:
                _, pull, primals = self.forward_vjp(c, inputs, x, self.key)
                return _residuals(pull, primals)[1]

            taken: set[int] = set()
            mine = []
            for a in jax.eval_shape(saved):
                kind = (tuple(a.shape), a.dtype)
                b = next((i for i, buffer in enumerate(buffers) if buffer == kind and i not in taken), len(buffers))
                if b == len(buffers):
                    buffers.append(kind)
                taken.add(b)
                mine.append(b)
            placement.append(mine)
        return buffers, placement

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> tuple[jax.Array, dict[str, jax.Array]]:
        buffers, _ = self.residual_layout
        carry = (
            tuple(jnp.zeros((self.slots["stash_slot"] + 1, *shape), dtype) for shape, dtype in buffers),
            jnp.zeros((self.slots["stash_slot"] + 1, *self.shape), self.dtype),  # chunk inputs
            jnp.zeros((self.slots["activation_slot"] + 1, *self.shape), self.dtype),
            jnp.zeros((self.slots["gradient_slot"] + 1, *self.shape), self.dtype),
            {name: jnp.zeros_like(value, self.grad_dtype or value.dtype) for name, value in self.local.items()},
            jnp.zeros((), jnp.float32),
        )
        (_, _, _, _, gacc, loss), _ = lax.scan(self.tick, carry, jnp.arange(self.tables["op"].shape[0]))
        return loss, gacc

    def tick(self, carry: Any, t: jax.Array) -> tuple[Any, None]:
        stash, stash_x, acts, grads_in, gacc, loss = carry
        s = lax.axis_index(self.axis)
        entry = {name: table[t, s] for name, table in self.tables.items()}
        op, c, m = entry["op"], entry["chunk"], entry["microbatch"]
        inputs = {k: v[m] for k, v in self.micro.items()}
        key = self.keys[m] if self.keys is not None else None

        def slot(name: str, buffer: str | None = None) -> jax.Array:
            """The table's slot for `name`, or the scratch slot of its buffer when it has none."""
            return jnp.where(entry[name] >= 0, entry[name], self.scratch[buffer or name])

        # Forward: branch 0 does nothing, branch 1 + c runs chunk c.
        is_forward = op == FORWARD
        x = acts[slot("activation_slot")]
        forwards = [self.no_forward, *(self.forward(i) for i in range(self.C))]
        with jax.named_scope(STAGE_BRANCHES):
            y, rows, gained = lax.switch(jnp.where(is_forward, c + 1, 0), forwards, x, inputs, key, m)
        keep = jnp.where(is_forward, slot("stash_slot"), self.scratch["stash_slot"])
        stash = tuple(buffer.at[keep].set(row) for buffer, row in zip(stash, rows, strict=True))
        stash_x = stash_x.at[keep].set(x)
        loss = loss + gained

        # Backward: branch 0 passes the accumulator through; then one branch per (op, chunk).
        backward_ops = [code for code in (BACKWARD, INPUT_GRAD, WEIGHT_GRAD) if code in self.used]
        branches = [self.no_backward]
        index = jnp.zeros((), jnp.int32)
        for k, code in enumerate(backward_ops):
            branches += [self.backward(i, code) for i in range(self.C)]
            index = jnp.where(op == code, 1 + k * self.C + c, index)
        read = jnp.where(index > 0, slot("stash_slot"), self.scratch["stash_slot"])
        kept = tuple(buffer[read] for buffer in stash)
        with jax.named_scope(STAGE_BRANCHES):
            added, dx = lax.switch(
                index, branches, kept, stash_x[read], grads_in[slot("gradient_slot")], inputs, key, m
            )
        gacc = {name: gacc[name] + added[name].astype(gacc[name].dtype) for name in gacc}

        # Ring sends outside the switches, by every stage alike (none at a tick where nothing
        # arrives anywhere). A stage runs one op a tick: it sends its forward's output or its
        # backward's input gradient, one buffer to both neighbours, and each keeps what it expects.
        from_previous, from_next = lax.cond(
            jnp.asarray(self.arrives)[t],
            self.send,
            lambda value: (jnp.zeros_like(value), jnp.zeros_like(value)),
            jnp.where(is_forward, y, dx),
        )
        acts = acts.at[slot("receive_activation", "activation_slot")].set(from_previous)
        grads_in = grads_in.at[slot("receive_gradient", "gradient_slot")].set(from_next)
        if "activation_from_next" in self.tables:
            # A V: values also go the other way round, or stay where they were made.
            acts = acts.at[slot("activation_from_next", "activation_slot")].set(from_next)
            acts = acts.at[slot("keep_activation", "activation_slot")].set(y)
            grads_in = grads_in.at[slot("gradient_from_previous", "gradient_slot")].set(from_previous)
            grads_in = grads_in.at[slot("keep_gradient", "gradient_slot")].set(dx)
        return (stash, stash_x, acts, grads_in, gacc, loss), None

    def send(self, value: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`value` sent to both neighbours round the ring: what arrives from the previous stage
        and from the next, by one all-gather (`sends_by_gather`) or one permutation each way."""
        P = lax.axis_size(self.axis)
        if sends_by_gather():
            every = lax.all_gather(value, self.axis)
            me = lax.axis_index(self.axis)
            return every[(me - 1) % P], every[(me + 1) % P]
        up, down = (tuple((s, (s + step) % P) for s in range(P)) for step in (1, -1))
        from_previous = lax.ppermute(value, self.axis, up)
        return from_previous, from_previous if down == up else lax.ppermute(value, self.axis, down)

    # ---- the branches -----------------------------------------------------------------------

    def no_forward(self, x: jax.Array, inputs: Any, key: Any, m: jax.Array) -> tuple[Any, ...]:
        buffers, _ = self.residual_layout
        return jnp.zeros(self.shape, self.dtype), tuple(jnp.zeros(s, d) for s, d in buffers), jnp.zeros((), jnp.float32)

    def forward(self, c: int) -> Callable[..., tuple[Any, ...]]:
        def go(buffer: jax.Array, inputs: dict[str, jax.Array], key: jax.Array | None, m: jax.Array) -> tuple[Any, ...]:
            (y, aux), pull, primals = self.forward_vjp(c, inputs, self._take(buffer, c), key)
            plan, residuals = _residuals(pull, primals)
            self.rebuild[c] = (jax.tree.structure(pull), plan, y.dtype)
            rows = self._pack(c, residuals)
            # The last chunk's output is its loss: it joins the total here, and is not sent.
            gained = aux / self.M + (y.astype(jnp.float32) * self.loss_weights[m] if c == self.C - 1 else 0.0)
            sent = jnp.zeros(self.shape, self.dtype) if c == self.C - 1 else self._fit(y)
            return sent, rows, gained

        return go

    def no_backward(self, *rest: Any) -> tuple[Any, jax.Array]:
        return {name: jnp.zeros_like(value) for name, value in self.local.items()}, jnp.zeros(self.shape, self.dtype)

    def backward(self, c: int, code: int) -> Callable[..., tuple[Any, jax.Array]]:
        weight_grads = code in (BACKWARD, WEIGHT_GRAD)
        input_grads = code in (BACKWARD, INPUT_GRAD) and c > 0

        def go(
            rows: tuple[jax.Array, ...],
            x: jax.Array,
            g: jax.Array,
            inputs: dict[str, jax.Array],
            key: jax.Array | None,
            m: jax.Array,
        ) -> tuple[Any, jax.Array]:
            treedef, plan, out_dtype = self.rebuild[c]
            w = self.weights(c)
            primals = (w,) if c == 0 else (w, self._take(x, c))
            pull = _rebuilt(treedef, plan, primals, self._unpack(c, rows))
            # The loss's gradient is d(mean over microbatches)/d(loss_m), and so is an
            # auxiliary loss's; any other chunk's output gradient arrived shaped as the next
            # chunk's input.
            out_ct = self.loss_weights[m] if c == self.C - 1 else self._take(g, c + 1)
            cts = pull((out_ct.astype(out_dtype), jnp.asarray(1.0 / self.M, jnp.float32)))
            if weight_grads:
                _, to_stored = jax.vjp(self.shares[c], self.local)
                (added,) = to_stored(cts[0])
            else:
                added = {name: jnp.zeros_like(value) for name, value in self.local.items()}
            dx = self._fit(cts[1]) if input_grads else jnp.zeros(self.shape, self.dtype)
            return added, dx

        return go

    # ---- buffers ----------------------------------------------------------------------------

    def _fit(self, y: jax.Array) -> jax.Array:
        """Pad a chunk's output into the shared boundary buffer."""
        return jnp.pad(y.astype(self.dtype), [(0, full - have) for full, have in zip(self.shape, y.shape, strict=True)])

    def _take(self, buffer: jax.Array, c: int) -> jax.Array:
        """Chunk c's own input out of the shared buffer."""
        return buffer[tuple(slice(0, n) for n in self.chunk_inputs[c])]

    def _pack(self, c: int, residuals: list[jax.Array]) -> tuple[jax.Array, ...]:
        """Chunk c's residuals in their buffers' rows (zeros in the buffers it does not use)."""
        buffers, placement = self.residual_layout
        rows = [jnp.zeros(shape, dtype) for shape, dtype in buffers]
        for value, b in zip(residuals, placement[c], strict=True):
            rows[b] = value
        return tuple(rows)

    def _unpack(self, c: int, rows: tuple[jax.Array, ...]) -> list[jax.Array]:
        _, placement = self.residual_layout
        return [rows[b] for b in placement[c]]


def sends_by_gather() -> bool:
    """Whether a tick's sends go as one all-gather over the stage axis, not as permutations: on
    XLA's CPU backend a ring's two collective-permutes take 0.8-1.1 ms, one all-gather of the
    same buffer 0.05-0.07 ms (16 simulated devices); elsewhere a permutation moves less."""
    return jax.default_backend() == "cpu"


def _residuals(pull: Any, primals: tuple[Any, ...]) -> tuple[list[tuple[str, Any]], list[jax.Array]]:
    """Split a backward's leaves into the primal values it reads again (the weights, the
    input: kept by position, never stashed), constants, and the residuals to stash (random
    keys as their raw bits, which a buffer can hold)."""
    position = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(primals))}
    plan: list[tuple[str, Any]] = []
    residuals: list[jax.Array] = []
    for leaf in jax.tree.leaves(pull):
        if id(leaf) in position:
            plan.append(("primal", position[id(leaf)]))
        elif not isinstance(leaf, jax.Array):
            plan.append(("constant", leaf))
        elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            plan.append(("key", (len(residuals), jax.random.key_impl(leaf))))
            residuals.append(jax.random.key_data(leaf))
        else:
            plan.append(("residual", len(residuals)))
            residuals.append(leaf)
    return plan, residuals


def _rebuilt(treedef: Any, plan: list[tuple[str, Any]], primals: tuple[Any, ...], residuals: list[jax.Array]) -> Any:
    """The backward again, from the primal values and the stashed residuals."""
    values = jax.tree.leaves(primals)
    leaves = []
    for kind, ref in plan:
        if kind == "primal":
            leaves.append(values[ref])
        elif kind == "residual":
            leaves.append(residuals[ref])
        elif kind == "key":
            leaves.append(jax.random.wrap_key_data(residuals[ref[0]], impl=ref[1]))
        else:
            leaves.append(ref)
    return jax.tree.unflatten(treedef, leaves)


class Share(NamedTuple):
    """A chunk's share of a stored array: `rows` picks them (ints, and (start, stop) ranges,
    over the leading dimensions; empty: all of it) and `shape` is the weight's own where a
    row is padded to a larger one."""

    stored: str
    rows: tuple[int | tuple[int, int], ...] = ()
    shape: tuple[int, ...] | None = None


def layer_shares(parameters: dict[str, Any], prefix: str, layers: tuple[int, int]) -> dict[str, Share]:
    """A chunk's layers [start, stop) of every array a repeat stores under `prefix` (`blocks.*.`)."""
    return {name: Share(name, (layers,)) for name in parameters if name.startswith(prefix)}


def take_share(arrays: dict[str, jax.Array], share: Share, stored: Parameter, local: bool, dtype: Any) -> jax.Array:
    """A chunk's weight out of a stored array (`stored` says how it is kept), in the compute
    dtype. `local`: `arrays` are one stage's pieces (inside the executor), where the stage's
    own dimension holds only its rows; otherwise they are the whole arrays.

    A dimension the share cuts (a row, a range of layers, a row's padding) that is split over
    an automatic mesh axis — ZeRO-3 or FSDP's data axes on a per-stage array's padded rows — is
    gathered first. Left to XLA's partitioner, a slice across the pieces moves each device's
    part by a collective-permute, and XLA runs one permute as one exchange among all the
    devices it names: those of every stage, while each stage takes its own branch of the
    executor's switch. The stages would wait for one another there for ever."""
    array = arrays[share.stored]
    index: list[int | slice] = []
    cut: set[int] = set()
    for dim, entry in enumerate(share.rows):
        if local and dim == stored.stage_rows:
            index.append(0 if isinstance(entry, int) else slice(None))
        elif isinstance(entry, int):
            index.append(entry)
            cut.add(dim)
        else:
            index.append(slice(*entry))
            if entry != (0, array.shape[dim]):
                cut.add(dim)
    kept = [dim for dim, entry in enumerate(index) if isinstance(entry, slice)] + list(range(len(index), array.ndim))
    for dim, n in zip(kept, share.shape or (), strict=False):
        if n < array.shape[dim]:
            cut.add(dim)
    value = _gathered(array, stored.sharding, cut)[tuple(index)]
    if share.shape is not None:
        value = value[tuple(slice(0, n) for n in share.shape)]
    return value.astype(dtype)


def _gathered(array: jax.Array, sharding: Any, dims: set[int]) -> jax.Array:
    """`array` (held as `sharding` says) whole along `dims` over the mesh's automatic axes;
    itself when none splits them."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    spec = [axes_of(entry) for entry in sharding]
    spec += [()] * (array.ndim - len(spec))
    if not any(a not in manual for dim in dims for a in spec[dim]):
        return array
    # Manual axes are left out: along them each device holds only its own piece already.
    kept = [() if dim in dims else tuple(a for a in axes if a not in manual) for dim, axes in enumerate(spec)]
    return lax.with_sharding_constraint(array, PartitionSpec(*(axes or None for axes in kept)))
