"""`Program`: a checked spec bound to a device mesh, ready to initialise, run and differentiate."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dslc.ir import nodes as ir
from dslc.ir.inputs import integer_bounds
from dslc.ir.state import state_sharding
from dslc.ir.weights import mismatches
from dslc.kernels.training import accumulate_gradients
from dslc.lower.model import DslcModel, Params, init_params, loss_count, run_forward, run_loss, split_loss
from dslc.lower.optim import make_optimizer
from dslc.lower.pipeline import PipelineExecutor
from dslc.lower.runtime import JNP_DTYPES, Runtime, partition_spec


class WeightsError(ValueError):
    """Weights that do not fit the program (names or shapes); nothing was loaded."""


@dataclass(frozen=True, slots=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled step, bytes per device. `total` is what the step
    holds at once as `dslc plan` counts it: arguments, outputs and temporaries, less the
    outputs that reuse a donated argument's buffer (the field notes, section 6, say why not
    XLA's own peak on CPU)."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


class Program:
    """A compiled spec on a mesh. Every method is jitted and sharded as the spec declares.

    `forward`, `loss` and `grads` evaluate the model deterministically (dropout off); the
    training step turns dropout on.
    """

    def __init__(self, program: ir.Program, mesh: jax.sharding.Mesh) -> None:
        self.ir = program
        self.mesh = mesh
        self._compute = JNP_DTYPES[program.train.compute_dtype]
        state = {path: state_sharding(w.type, program) for path, w in ir.weights_by_path(program).items()}

        def named(pick: Any) -> dict[str, NamedSharding]:
            return {path: NamedSharding(mesh, partition_spec(pick(s))) for path, s in state.items()}

        # Where parameters, gradients and optimizer state live (ZeRO stages 0-3).
        self._shardings = named(lambda s: s.params)
        self._grad_shardings = named(lambda s: s.grads)
        self._optimizer_shardings = named(lambda s: s.optimizer)
        self.optimizer = make_optimizer(program.train.optimizer)
        p = program.pipeline
        pipelined = p is not None and program.mesh.size((p.axis,)) * p.virtual > 1
        self._pipeline = PipelineExecutor(program, mesh, self._compute) if pipelined else None
        abstract_params = {
            path: jax.ShapeDtypeStruct(w.type.shape, JNP_DTYPES[w.type.dtype])
            for path, w in ir.weights_by_path(program).items()
        }
        self._opt_state_shardings = self._state_shardings(jax.eval_shape(self.optimizer.init, abstract_params))

    # --- parameters ---------------------------------------------------------------------------

    def init(self, seed: int) -> DslcModel:
        with jax.set_mesh(self.mesh):
            return DslcModel(init_params(self.ir, self._shardings, seed))

    def export_weights(self, model: DslcModel) -> dict[str, np.ndarray]:
        # Copies: on CPU a fetched array may share the device buffer, which the next
        # (donating) train step frees and reuses.
        return {name: np.array(jax.device_get(value), copy=True) for name, value in model.arrays().items()}

    def import_weights(self, model: DslcModel, weights: Mapping[str, Any]) -> None:
        """Load a dict of arrays by dotted name. Every name and shape is checked before any
        value is replaced, so a mismatch leaves the model as it was."""
        problems = mismatches(self.ir, {name: tuple(np.shape(value)) for name, value in weights.items()})
        if problems:
            raise WeightsError("cannot load weights, nothing was loaded: " + "; ".join(problems))
        expected = ir.weights_by_path(self.ir)
        dtypes = {name: JNP_DTYPES[w.type.dtype] for name, w in expected.items()}
        placed = {
            name: jax.device_put(np.asarray(weights[name], dtype=dtypes[name]), self._shardings[name])
            for name in expected
        }
        for name, value in placed.items():
            model.params[name].set_value(value)

    def param_shardings(self, model: DslcModel) -> dict[str, PartitionSpec]:
        return {name: value.sharding.spec for name, value in model.arrays().items()}  # type: ignore[attr-defined]

    # --- running ------------------------------------------------------------------------------

    # Every computation traces under the mesh: kernels that enter `shard_map` (ring
    # attention, expert-parallel mixtures of experts, the pipeline) find it there.
    def forward(self, model: DslcModel, inputs: Mapping[str, Any]) -> jax.Array:
        with jax.set_mesh(self.mesh):
            return self._forward(model.arrays(), self._place(inputs))[0]

    def loss(self, model: DslcModel, batch: Mapping[str, Any]) -> jax.Array:
        """The training objective: the loss layer's value plus the layers' auxiliary losses."""
        with jax.set_mesh(self.mesh):
            return self._loss(model.arrays(), self._place(batch))

    def aux(self, model: DslcModel, inputs: Mapping[str, Any]) -> dict[str, float]:
        """The auxiliary values the layers return on `inputs`, summed over the layers (dropout
        off): `aux_loss`, the part of `loss` that is not the loss layer's, and a mixture of
        experts' `moe_dropped` and `moe_routed` (token-to-expert choices dropped for want of
        capacity, and made). Empty for a model whose layers return none."""
        with jax.set_mesh(self.mesh):
            aux = self._forward(model.arrays(), self._place(inputs))[1]
        return {name: float(value) for name, value in aux.items()}

    def grads(self, model: DslcModel, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        with jax.set_mesh(self.mesh):
            grads = self._grads(model.arrays(), self._place(batch))
        return {name: np.asarray(jax.device_get(g)) for name, g in grads.items()}

    def example_batch(self, seed: int) -> dict[str, np.ndarray]:
        """Random inputs with the names, shapes and dtypes the spec declares; integer inputs
        are drawn below the vocabulary or class count of the layer that reads them."""
        rng = np.random.default_rng(seed)
        bounds = integer_bounds(self.ir)
        batch = {}
        for inp in self.ir.inputs:
            t = inp.type
            if t.dtype in ir.INT_DTYPES:
                batch[inp.name] = rng.integers(0, bounds.get(inp.name, 2), size=t.shape).astype(
                    np.dtype(JNP_DTYPES[t.dtype])
                )
            else:
                batch[inp.name] = rng.standard_normal(t.shape).astype(np.dtype(JNP_DTYPES[t.dtype]))
        return batch

    # --- training -----------------------------------------------------------------------------

    def init_optimizer(self, model: DslcModel) -> Any:
        """The optimizer state, split like the spec's ZeRO stage says (stage >= 1: over the
        data axes)."""
        return jax.jit(self.optimizer.init, out_shardings=self._opt_state_shardings)(model.arrays())

    def train_step(self, model: DslcModel, opt_state: Any, batch: Mapping[str, Any], step: int) -> tuple[Any, float]:
        """One optimizer step on `batch` (dropout on, keyed by `step`); updates `model` in
        place and returns the new optimizer state and the loss before the step."""
        key = jax.random.key(step)
        with jax.set_mesh(self.mesh):
            params, opt_state, loss = self._step(model.arrays(), opt_state, self._place(batch), key)
        for name, value in params.items():
            model.params[name].set_value(value)
        return opt_state, float(loss)

    def _state_shardings(self, tree: Any) -> Any:
        """Optimizer-state leaves shaped like a parameter follow its optimizer sharding."""
        weights = ir.weights_by_path(self.ir)
        replicated = NamedSharding(self.mesh, PartitionSpec())

        def pick(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
            for entry in path:
                name = getattr(entry, "key", None)
                if name in weights and tuple(leaf.shape) == weights[name].type.shape:
                    return self._optimizer_shardings[name]
            return replicated

        return jax.tree_util.tree_map_with_path(pick, tree)

    @functools.cached_property
    def _step(self) -> Any:
        def step(
            params: Params, opt_state: Any, batch: dict[str, jax.Array], key: jax.Array
        ) -> tuple[Params, Any, jax.Array]:
            loss, grads = self._value_and_grad(params, batch, key)
            grads = jax.lax.with_sharding_constraint(grads, self._grad_shardings)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.jit(
            step, out_shardings=(self._shardings, self._opt_state_shardings, replicated), donate_argnums=(0, 1)
        )

    def compiled_memory(self, step: Literal["grads", "train"] = "train") -> CompiledMemory:
        """Compile the gradient step (`grads`) or the whole training step (`train`: gradients
        and optimizer update, parameters and optimizer state donated) for this mesh, and report
        XLA's memory analysis per device. Nothing is allocated: the step is compiled for
        abstract arrays with the program's shardings."""
        weights = ir.weights_by_path(self.ir)
        params = {
            path: jax.ShapeDtypeStruct(w.type.shape, JNP_DTYPES[w.type.dtype], sharding=self._shardings[path])
            for path, w in weights.items()
        }
        batch = {
            inp.name: jax.ShapeDtypeStruct(
                inp.type.shape,
                JNP_DTYPES[inp.type.dtype],
                sharding=NamedSharding(self.mesh, partition_spec(inp.type.sharding)),
            )
            for inp in self.ir.inputs
        }
        with jax.set_mesh(self.mesh):
            if step == "grads":
                lowered = self._grads.lower(params, batch)
            else:
                state = jax.tree.map(
                    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                    jax.eval_shape(self.optimizer.init, params),
                    self._opt_state_shardings,
                )
                lowered = self._step.lower(params, state, batch, jax.random.key(0))
            stats = lowered.compile().memory_analysis()
        return CompiledMemory(
            int(stats.argument_size_in_bytes),
            int(stats.output_size_in_bytes),
            int(stats.temp_size_in_bytes),
            int(stats.alias_size_in_bytes),
        )

    # --- internals ----------------------------------------------------------------------------

    def _runtime(self, batch: Mapping[str, jax.Array], key: jax.Array | None = None) -> Runtime:
        return Runtime(self.mesh, self._compute, dict(batch), training=key is not None, dropout_key=key)

    def _place(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Put each input on the mesh with its declared sharding (checking its shape)."""
        placed: dict[str, jax.Array] = {}
        for inp in self.ir.inputs:
            if inp.name not in batch:
                continue
            value = np.asarray(batch[inp.name])
            if value.shape != inp.type.shape:
                raise ValueError(f"input `{inp.name}` has shape {value.shape}, the spec says {inp.type.shape}")
            value = value.astype(np.dtype(JNP_DTYPES[inp.type.dtype]))
            # Every process holds the whole batch and builds only its own devices' shards;
            # device_put onto a mesh spanning processes would all-gather it to compare first.
            sharding = NamedSharding(self.mesh, partition_spec(inp.type.sharding))
            placed[inp.name] = jax.make_array_from_callback(value.shape, sharding, value.__getitem__)
        missing = [i.name for i in self.ir.inputs if i.name not in placed and (i.name == self.ir.stream)]
        if missing:
            raise ValueError(f"missing input `{missing[0]}`")
        return placed

    @functools.cached_property
    def _forward(self) -> Any:
        def forward(params: Params, inputs: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
            return run_forward(self.ir, params, inputs, self._runtime(inputs))

        return jax.jit(forward)

    @functools.cached_property
    def _loss(self) -> Any:
        return jax.jit(self._loss_fn)

    def _loss_fn(self, params: Params, batch: dict[str, jax.Array], key: jax.Array | None = None) -> jax.Array:
        if split_loss(self.ir)[1] is None:
            raise ValueError(f"spec `{self.ir.name}` has no loss layer (cross_entropy or mse) at the end of `forward`")
        return run_loss(self.ir, params, batch, self._runtime(batch, key))

    @functools.cached_property
    def _grads(self) -> Any:
        def grads(params: Params, batch: dict[str, jax.Array]) -> Params:
            return self._value_and_grad(params, batch, None)[1]

        return jax.jit(grads, out_shardings=self._grad_shardings)

    def _value_and_grad(
        self, params: Params, batch: dict[str, jax.Array], key: jax.Array | None
    ) -> tuple[jax.Array, Params]:
        """Loss and gradients, over `accumulate` slices of the batch when the spec asks; through
        the pipeline schedule when the spec has one."""
        once: Any = self._pipeline.value_and_grad if self._pipeline is not None else jax.value_and_grad(self._loss_fn)
        return accumulate_gradients(once, params, batch, key, self.ir.train.accumulate, loss_count(self.ir))
