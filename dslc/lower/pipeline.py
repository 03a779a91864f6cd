"""A pipelined program's loss and gradients: its chunks and its schedule's table, handed to
the one executor in `dslc.kernels.pipeline` (which the generated code runs too)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dslc.ir import nodes as ir
from dslc.ir.boundaries import boundary_of, chunk_input
from dslc.kernels.layers import AUX_LOSS
from dslc.kernels.pipeline import TABLE_ENTRIES, pipeline_value_and_grad
from dslc.layers import LOSS_KINDS, RULES
from dslc.lower.model import Params, call_kernel, forward_nodes
from dslc.lower.runtime import JNP_DTYPES, Runtime
from dslc.plan.timetable import schedule_table
from dslc.schedules.buffers import ExecutionPlan, allocate_slots


class PipelineExecutor:
    """Loss and gradients of a pipelined program, by running its schedule's table."""

    def __init__(self, program: ir.Program, mesh: jax.sharding.Mesh, compute_dtype: Any) -> None:
        p = program.pipeline
        assert p is not None
        self.program = program
        self.mesh = mesh
        self.axis = p.axis
        self.microbatches = p.microbatches
        self.compute_dtype = compute_dtype
        self.schedule = schedule_table(program)
        self.plan: ExecutionPlan = allocate_slots(self.schedule)
        self.chunks = program.chunks
        last = self.chunks[-1].nodes
        assert last and isinstance(last[-1], ir.Layer) and last[-1].kind in LOSS_KINDS, "the checker guarantees a loss"
        self.loss_layer = last[-1]
        self.weights_of = [
            tuple(f"{layer.path}.{w.name}" for layer in ir.layers(chunk.nodes) for w in layer.weights)
            for chunk in self.chunks
        ]
        self.table = {name: getattr(self.plan, name) for name in TABLE_ENTRIES}
        # Chunks hand the executor their auxiliary losses only where some layer has one, so
        # every other model runs exactly the executor it always did.
        self.has_aux = any(RULES[layer.kind].has_aux for layer in ir.all_layers(program))

    def boundary(self) -> tuple[tuple[int, ...], Any]:
        """The buffer every inter-stage tensor fits in: one microbatch of the largest one."""
        shape, dtype = boundary_of(self.program, self.microbatches)
        return shape, JNP_DTYPES[dtype] if dtype else self.compute_dtype

    def _chunk(self, c: int) -> Any:
        """Chunk c as a function of its weights and its input; the last one ends in the loss.
        With `has_aux` it returns the sum of its layers' auxiliary losses as well."""
        chunk = self.chunks[c]
        last = c == len(self.chunks) - 1
        nodes = chunk.nodes[:-1] if last else chunk.nodes

        def run(params: Params, x: jax.Array, inputs: dict[str, jax.Array], key: jax.Array | None) -> Any:
            rt = Runtime(
                self.mesh,
                self.compute_dtype,
                inputs,
                training=key is not None,
                dropout_key=key,
                manual_axes=(self.axis,),
            )
            y, aux = forward_nodes(nodes, x, params, rt)
            if last:
                y, _ = call_kernel(self.loss_layer, y, {}, rt)
            return (y, aux.get(AUX_LOSS, jnp.zeros((), jnp.float32))) if self.has_aux else y

        return run

    def value_and_grad(
        self, params: Params, batch: dict[str, jax.Array], key: jax.Array | None
    ) -> tuple[jax.Array, Params]:
        M = self.microbatches
        loss, grads = pipeline_value_and_grad(
            [self._chunk(c) for c in range(len(self.chunks))],
            [{n: params[n] for n in names} for names in self.weights_of],
            batch,
            key,
            table=self.table,
            mesh=self.mesh,
            axis=self.axis,
            stream=self.program.stream,
            microbatches=M,
            chunk_inputs=[chunk_input(chunk, M) for chunk in self.chunks],
            boundary=self.boundary(),
            has_aux=self.has_aux,
        )
        return loss, {n: g for chunk in grads for n, g in chunk.items()}
