"""dslc's lowering of specs/gpt_small.par against the same model written by hand in Flax NNX.

    .venv/bin/python -m bench.bench_lowering [--steps N]     (or: .venv/bin/python bench/bench_lowering.py)

One process, 16 simulated CPU devices, the spec's default 2x4x2 (data x model x stage) mesh.
The hand-written GPT below is what an engineer would write for this model without dslc: NNX
modules whose parameters carry the spec's shardings, batch split over `data`, Megatron
tensor parallelism over `model`, activations pinned at block boundaries, the spec's selective
checkpointing, optax adamw with the spec's hyperparameters. It comes in two forms: blocks in
a Python loop (what nanoGPT and gemma write) and blocks stacked and run by `nnx.scan` (what
MaxText writes, and how dslc lowers a `repeat`). It does not pipeline: `stage` replicates it.

dslc runs twice: the spec as written (its train step runs the 1F1B schedule over `stage`,
4 microbatches) and the spec with its pipeline removed (`stage` replicates the model, the
plan the hand-written code follows), which isolates the lowering from the pipeline.

All start from dslc's initial weights (exported, loaded by name) and train on the same batch.
Printed: a numerics check (dropout 0: the losses must agree), compile times, the median
steady-state step both as a training loop calls it and as the bare compiled step, the ratios
dslc / hand-written, and the collectives XLA placed in each compiled program.

With `--floor`, the pipelined step is taken apart: the same ticks without their sends, and
each stage's forward and backward ticks back to back with neither sends nor bubble (both with
wrong numbers, for timing only), next to the unpipelined step. Wall time on these simulated
devices follows the slowest chain of collectives when the machine is idle and the CPU time
when it is loaded, so the process CPU time of each step is printed beside it.
"""

from __future__ import annotations

import re

from dslc.lower.devices import request_host_devices

# XLA fixes the number of CPU devices when jax starts: asked for before `import jax`.
request_host_devices(16)

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import dslc
from dslc.ir.schedule import schedule_table
from dslc.runtime.training import OPTIMIZER_DEFAULTS

SPEC = Path(__file__).resolve().parent.parent / "specs" / "gpt_small.par"
SEED = 0
WARMUP_ROUNDS = 3
CHECK_STEPS = 5
TARGET_RATIO = 1.05  # dslc without its pipeline / the hand-written scan
PIPELINE_TARGET = 1.10  # dslc's 1F1B step / the same spec without its pipeline
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# ---- the hand-written model ------------------------------------------------------------------

# specs/gpt_small.par, written out.
VOCAB, D, HEADS, FFN, SEQ, BATCH, LAYERS = 128, 64, 4, 256, 32, 16, 4
DROPOUT = 0.1
OPTIMIZER = {**OPTIMIZER_DEFAULTS, "lr": 1e-3, "warmup": 50, "weight_decay": 0.1}

# No pipeline: `stage` holds replicas of the whole model. Batch over `data`, features whole
# between blocks, logits split over the vocabulary like the head's kernel.
ACTIVATIONS = P("data", None, None)
LOGITS = P("data", None, "model")
# The spec's `checkpoint selective(attn)`: keep each block's attention output for the
# backward pass, recompute the rest of the block.
SAVE_ATTENTION = jax.checkpoint_policies.save_only_these_names("attn")


def fan_in(n: int) -> nnx.Initializer:
    return nnx.initializers.normal(n**-0.5)


class Embed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        # Vocab parallel: each `model` shard holds a quarter of the rows.
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (VOCAB, D)), out_sharding=("model", None))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # A gather; XLA partitions it as a masked local lookup and one all-reduce over `model`.
        return self.table[...][tokens]


class CausalSelfAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        # q, k, v column parallel (whole heads per `model` shard), o row parallel: one
        # all-reduce per attention, at the output projection.
        self.q = nnx.Param(fan_in(D)(rngs.params(), (D, D)), out_sharding=(None, "model"))
        self.k = nnx.Param(fan_in(D)(rngs.params(), (D, D)), out_sharding=(None, "model"))
        self.v = nnx.Param(fan_in(D)(rngs.params(), (D, D)), out_sharding=(None, "model"))
        self.o = nnx.Param(fan_in(D)(rngs.params(), (D, D)), out_sharding=("model", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        heads = (b, s, HEADS, D // HEADS)
        q, k, v = (jnp.einsum("bsd,de->bse", x, w[...]).reshape(heads) for w in (self.q, self.k, self.v))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.einsum("bse,ed->bsd", out.reshape(b, s, D), self.o[...])


class Block(nnx.Module):
    def __init__(self, dropout: float, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.attn = CausalSelfAttention(rngs)
        self.ln2 = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(
            D,
            FFN,
            kernel_init=fan_in(D),
            kernel_metadata={"out_sharding": (None, "model")},
            bias_metadata={"out_sharding": ("model",)},
            rngs=rngs,
        )
        self.down = nnx.Linear(
            FFN, D, kernel_init=fan_in(FFN), kernel_metadata={"out_sharding": ("model", None)}, rngs=rngs
        )
        self.dropout = nnx.Dropout(dropout)

    @nnx.remat(policy=SAVE_ATTENTION)
    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        """`key` None evaluates (dropout off); a key trains."""
        attn_key, mlp_key = jax.random.split(key) if key is not None else (None, None)
        h = checkpoint_name(self.attn(self.ln1(x)), "attn")
        x = x + self.dropout(h, deterministic=key is None, rngs=attn_key)
        h = self.down(jax.nn.gelu(self.up(self.ln2(x)), approximate=True))
        x = x + self.dropout(h, deterministic=key is None, rngs=mlp_key)
        return jax.lax.with_sharding_constraint(x, ACTIVATIONS)


class GPT(nnx.Module):
    """Blocks in a Python loop, as nanoGPT and gemma write it: XLA sees four copies of the block."""

    def __init__(self, dropout: float, rngs: nnx.Rngs) -> None:
        self.embed = Embed(rngs)
        self.blocks = self.make_blocks(dropout, rngs)
        self.ln_f = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(
            D,
            VOCAB,
            use_bias=False,
            kernel_init=fan_in(D),
            kernel_metadata={"out_sharding": (None, "model")},
            rngs=rngs,
        )

    def make_blocks(self, dropout: float, rngs: nnx.Rngs) -> Any:
        return nnx.List([Block(dropout, rngs) for _ in range(LAYERS)])

    def run_blocks(self, x: jax.Array, keys: jax.Array | None) -> jax.Array:
        for i, block in enumerate(self.blocks):
            x = block(x, None if keys is None else keys[i])
        return x

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        x = jax.lax.with_sharding_constraint(self.embed(tokens), ACTIVATIONS)
        x = self.run_blocks(x, None if key is None else jax.random.split(key, LAYERS))
        return jax.lax.with_sharding_constraint(self.head(self.ln_f(x)), LOGITS)


class ScannedGPT(GPT):
    """The blocks' parameters stacked on a leading layer axis and run by `nnx.scan`: one
    traced block whatever the depth."""

    def make_blocks(self, dropout: float, rngs: nnx.Rngs) -> Any:
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def stacked(rngs: nnx.Rngs) -> Block:
            return Block(dropout, rngs)

        return stacked(rngs)

    def run_blocks(self, x: jax.Array, keys: jax.Array | None) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def step(h: jax.Array, block: Block, key: jax.Array | None) -> jax.Array:
            return block(h, key)

        return step(x, self.blocks, keys)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(targets, VOCAB)).mean()


def make_optimizer() -> optax.GradientTransformation:
    h = OPTIMIZER
    warmup = optax.linear_schedule(0.0, h["lr"], int(h["warmup"]))
    lr = optax.join_schedules([warmup, optax.constant_schedule(h["lr"])], [int(h["warmup"])])
    return optax.adamw(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"])


def shardings(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.sharding, tree)


def load_weights(model: GPT, weights: Mapping[str, np.ndarray]) -> None:
    """Every parameter from dslc's weights by dotted name; a scanned model's stacked block
    parameter `blocks.attn.q` takes `blocks.0.attn.q` ... `blocks.3.attn.q`."""
    used = set()
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        name = ".".join(map(str, path))
        if name in weights:
            names = [name]
            value = weights[name]
        else:
            names = [name.replace("blocks.", f"blocks.{i}.", 1) for i in range(LAYERS)]
            value = np.stack([weights[n] for n in names])
        assert value.shape == node.shape, f"{name}: dslc has {value.shape}, the hand-written model {node.shape}"
        node.set_value(jax.device_put(value, node[...].sharding))
        used.update(names)
    assert used == set(weights), f"weights the hand-written model lacks: {sorted(set(weights) - used)}"


# ---- dslc's variants of the spec --------------------------------------------------------------

_NO_DROPOUT = ((r"dropout\(0\.1\)", "dropout(0.0)", 2),)
# Unwrap `stages { ... }` and drop the `pipeline` section: one chunk, `stage` left unused.
_NO_PIPELINE = (
    (r"(?ms)^( *)stages \{\n(.*?)^\1\}\n", r"\2", 1),
    (r"(?ms)^pipeline \w+ \{\n.*?^\}\n", "", 1),
)


def spec_text(*, dropout: bool, pipeline: bool) -> str:
    text = SPEC.read_text(encoding="utf-8")
    edits = (() if dropout else _NO_DROPOUT) + (() if pipeline else _NO_PIPELINE)
    for pattern, replacement, expected in edits:
        text, n = re.subn(pattern, replacement, text)
        if n != expected:
            raise SystemExit(
                f"specs/gpt_small.par changed: `{pattern}` matched {n} times; update bench/bench_lowering.py"
            )
    return text


# ---- the contenders -------------------------------------------------------------------------


def count_collectives(compiled_text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", compiled_text)) for op in COLLECTIVES}


def seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass
class Compiled:
    """A contender's train step compiled ahead of time, and what the compiler made of it."""

    lower_s: float
    compile_s: float
    forward_collectives: dict[str, int]
    step_collectives: dict[str, int]
    # The compiled step alone, on device-resident inputs, waited for.
    jitted_step: Callable[[], None]


class Contender(Protocol):
    name: str
    front_end_s: float | None

    def train_step(self) -> float:
        """One step as a training loop takes it: a host batch in, the loss out as a float,
        and every device done (reading the loss waits only for the device it is read from;
        the others' unfinished work would be billed to whatever is timed next). The
        optimizer state has a piece on every device, so waiting for it waits for all."""
        ...

    def eval_loss(self) -> float: ...

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights under dslc's dotted names."""
        ...

    def compile(self) -> Compiled: ...


class DslcContender:
    """dslc's `Program`: `train_step` is its public method; `lower("train")` gives the step
    it runs, compiled here ahead of time."""

    def __init__(self, name: str, source: str, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> None:
        self.name = name
        self.front_end_s, self.program = seconds(lambda: dslc.compile(source))
        self.model = self.program.init(SEED)
        self.program.import_weights(self.model, weights)
        self.opt_state = self.program.init_optimizer(self.model)
        self.batch = batch
        self.steps = itertools.count()

    def train_step(self) -> float:
        self.opt_state, loss = self.program.train_step(self.model, self.opt_state, self.batch, next(self.steps))
        jax.block_until_ready(self.opt_state)
        return loss

    def eval_loss(self) -> float:
        return float(self.program.loss(self.model, self.batch))

    def weights(self) -> dict[str, np.ndarray]:
        return self.program.export_weights(self.model)

    def compile(self) -> Compiled:
        program = self.program
        params, placed, key = self.model.arrays(), program.place(self.batch, loss=True), jax.random.key(0)
        # Under the program's mesh, as `Program.train_step` calls it.
        with jax.set_mesh(program.mesh):
            lower_s, lowered = seconds(lambda: program.lower("train"))
            compile_s, step = seconds(lowered.compile)
            forward = program.lower("forward").compile()
        # The step donates its inputs, so it trains copies while `model` trains on.
        state = jax.tree.map(jnp.copy, (params, self.opt_state))

        def jitted_step() -> None:
            nonlocal state
            new_params, opt_state, *_ = step(*state, placed, key)
            state = jax.block_until_ready((new_params, opt_state))

        return Compiled(
            lower_s, compile_s, count_collectives(forward.as_text()), count_collectives(step.as_text()), jitted_step
        )


class HandContender:
    """A hand-written model trained the functional NNX way: `nnx.split` once, then a jitted
    step over the pure parameter state, the shape of dslc's own step."""

    front_end_s = None

    def __init__(
        self,
        name: str,
        model_class: type[GPT],
        dropout: float,
        mesh: jax.sharding.Mesh,
        weights: dict[str, np.ndarray],
        batch: dict[str, np.ndarray],
    ) -> None:
        self.name = name
        self.mesh = mesh
        self.optimizer = make_optimizer()
        with jax.set_mesh(mesh):
            model = model_class(dropout, nnx.Rngs(SEED))
            load_weights(model, weights)
            self.graphdef, self.params = nnx.split(model)
            # Eagerly under the mesh: each moment takes its parameter's sharding and the step
            # count lands replicated on the mesh (under jit XLA may replicate the moments).
            self.opt_state = self.optimizer.init(self.params)
        self.batch = batch
        self.batch_sharding = NamedSharding(mesh, P("data", None))
        self.steps = itertools.count()
        # Outputs pinned to the inputs' shardings, so the donated buffers are reused and the
        # next call sees the same input shardings.
        replicated = NamedSharding(mesh, P())
        out_shardings = (shardings(self.params), shardings(self.opt_state), replicated)
        self.step = jax.jit(self._train_step, donate_argnums=(0, 1), out_shardings=out_shardings)

    def _loss(self, params: nnx.State, batch: dict[str, jax.Array], key: jax.Array | None = None) -> jax.Array:
        return cross_entropy(nnx.merge(self.graphdef, params)(batch["tokens"], key), batch["targets"])

    def _train_step(
        self, params: nnx.State, opt_state: Any, batch: dict[str, jax.Array], key: jax.Array
    ) -> tuple[nnx.State, Any, jax.Array]:
        loss, grads = jax.value_and_grad(self._loss)(params, batch, key)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def place(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return {name: jax.device_put(value, self.batch_sharding) for name, value in batch.items()}

    def train_step(self) -> float:
        key = jax.random.key(next(self.steps))
        with jax.set_mesh(self.mesh):
            self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.place(self.batch), key)
        jax.block_until_ready(self.opt_state)
        return float(loss)

    def eval_loss(self) -> float:
        with jax.set_mesh(self.mesh):
            return float(jax.jit(self._loss)(self.params, self.place(self.batch)))

    def weights(self) -> dict[str, np.ndarray]:
        flat = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(self.params)}
        out = {}
        for name, value in flat.items():
            if name.startswith("blocks.") and not name.split(".")[1].isdigit():
                out.update({name.replace("blocks.", f"blocks.{i}.", 1): layer for i, layer in enumerate(value)})
            else:
                out[name] = value
        return out

    def compile(self) -> Compiled:
        placed, key = self.place(self.batch), jax.random.key(0)
        forward = jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params)(tokens))
        with jax.set_mesh(self.mesh):
            lower_s, lowered = seconds(lambda: self.step.lower(self.params, self.opt_state, placed, key))
            compile_s, step = seconds(lowered.compile)
            forward_text = forward.lower(self.params, placed["tokens"]).compile().as_text()
        # The training loop calls this executable from now on, rather than compile it again.
        self.step = step
        state = jax.tree.map(jnp.copy, (self.params, self.opt_state))

        def jitted_step() -> None:
            nonlocal state
            new_params, opt_state, _ = step(*state, placed, key)
            state = jax.block_until_ready((new_params, opt_state))

        return Compiled(
            lower_s, compile_s, count_collectives(forward_text), count_collectives(step.as_text()), jitted_step
        )


def contenders(
    mesh: jax.sharding.Mesh, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray], *, dropout: bool
) -> list[Contender]:
    rate = DROPOUT if dropout else 0.0
    return [
        DslcContender("dslc", spec_text(dropout=dropout, pipeline=True), weights, batch),
        DslcContender("dslc-nopipe", spec_text(dropout=dropout, pipeline=False), weights, batch),
        HandContender("hand-loop", GPT, rate, mesh, weights, batch),
        HandContender("hand-scan", ScannedGPT, rate, mesh, weights, batch),
    ]


# ---- the report ---------------------------------------------------------------------------------


def check_numerics(runs: list[Contender]) -> None:
    """Dropout off, same weights, same batch: the losses must agree to float32 rounding (the
    programs sum in different orders), and so must the weights after a few adamw steps."""
    evals = {c.name: c.eval_loss() for c in runs}
    losses = {c.name: [c.train_step() for _ in range(CHECK_STEPS)] for c in runs}
    reference = runs[0].weights()
    drift = {c.name: max(float(np.max(np.abs(w - reference[n]))) for n, w in c.weights().items()) for c in runs[1:]}
    print("numerics, dropout 0 (same weights, same batch); rel = |x - dslc| / |dslc|:")
    rows = (
        ("eval loss", evals),
        ("first train-step loss", {k: v[0] for k, v in losses.items()}),
        (f"train-step loss {CHECK_STEPS}", {k: v[-1] for k, v in losses.items()}),
    )
    for label, values in rows:
        first = values[runs[0].name]
        others = "  ".join(
            f"{k} {v:.7f} (rel {abs(v - first) / abs(first):.1e})" for k, v in values.items() if k != runs[0].name
        )
        print(f"  {label:<22} {runs[0].name} {first:.7f}  {others}")
    print(f"  max |weight - dslc's| after {CHECK_STEPS} steps: " + "  ".join(f"{k} {v:.1e}" for k, v in drift.items()))


# Per run: milliseconds per training-loop step, per bare compiled step, and the process CPU
# time of each bare step (all threads: what the step costs the machine, whatever else runs).
Samples = dict[str, tuple[list[float], list[float], list[float]]]


def time_steps(
    runs: list[Contender], compiled: dict[str, Compiled], steps: int, extra: dict[str, Compiled] | None = None
) -> Samples:
    """Milliseconds per training-loop step and per bare compiled step, for each run, and per
    bare step of each `extra` compiled step. Every run takes one step per round, in turn, so
    load from other processes falls on all alike."""
    calls = [(c.name, 0, c.train_step) for c in runs]
    calls += [(name, 1, done.jitted_step) for name, done in (compiled | (extra or {})).items()]
    times: Samples = {name: ([], [], []) for name, _, _ in calls}
    for round_ in range(WARMUP_ROUNDS + steps):
        for name, kind, call in calls:
            cpu = time.process_time()
            elapsed, _ = seconds(call)
            if round_ >= WARMUP_ROUNDS:
                times[name][kind].append(elapsed * 1e3)
                if kind == 1:
                    times[name][2].append((time.process_time() - cpu) * 1e3)
    return times


def report(runs: list[Contender], compiled: dict[str, Compiled], times: Samples, steps: int) -> None:
    print("\ncompile, seconds (the train step, lowered then compiled ahead of time):")
    print(f"  {'':<12} {'front end':>9} {'lower':>7} {'compile':>8}")
    for c in runs:
        front = f"{c.front_end_s:.2f}" if c.front_end_s is not None else "-"
        print(f"  {c.name:<12} {front:>9} {compiled[c.name].lower_s:>7.2f} {compiled[c.name].compile_s:>8.2f}")

    # The minimum is printed beside the median: on a shared machine it is the steadier figure.
    medians = {c.name: tuple(statistics.median(times[c.name][i]) for i in (0, 1, 2)) for c in runs}
    minima = {c.name: tuple(min(times[c.name][i]) for i in (0, 1, 2)) for c in runs}
    print(f"\nsteady-state train step over {steps} interleaved rounds, ms, median (min):")
    print(f"  {'':<26} {'train_step':>17} {'jitted step':>17}")
    for name in medians:
        cells = (f"{medians[name][i]:.2f} ({minima[name][i]:.2f})" for i in (0, 1))
        print(f"  {name:<26} " + " ".join(f"{cell:>17}" for cell in cells))
    print(f"  ratio of medians (of minima); target <= {TARGET_RATIO}:")
    for mine, theirs in itertools.product(("dslc", "dslc-nopipe"), ("hand-loop", "hand-scan")):
        cells = (
            f"{medians[mine][i] / medians[theirs][i]:.3f} ({minima[mine][i] / minima[theirs][i]:.3f})" for i in (0, 1)
        )
        print(f"  {f'{mine} / {theirs}':<26} " + " ".join(f"{cell:>17}" for cell in cells))

    # The pipeline's own cost: the same spec run by the schedule's executor or unpipelined.
    # On simulated CPU devices the unpipelined step repeats the model on every stage, and the
    # pipelined one idles devices in its bubble, so the ratio bounds the executor's overhead
    # rather than predicting a GPU's.
    ticks = pipeline_ticks(runs[0])
    for i, label in ((0, "train_step"), (1, "jitted step"), (2, "jitted step, process CPU time")):
        pipe, flat = medians["dslc"][i], medians["dslc-nopipe"][i]
        of_minima = minima["dslc"][i] / minima["dslc-nopipe"][i]
        print(
            f"  dslc / dslc-nopipe, {label}: {pipe / flat:.3f} (of minima {of_minima:.3f}; target <= "
            f"{PIPELINE_TARGET}); {ticks} ticks, {(pipe - flat) / ticks:+.3f} ms per tick over the unpipelined step"
        )

    print("\ncollectives in the compiled HLO, forward | train step (an op in a loop body counts once):")
    print("  " + " " * 12 + "".join(f"{op:>20}" for op in COLLECTIVES))
    for c in runs:
        done = compiled[c.name]
        cells = "".join(f"{f'{done.forward_collectives[op]} | {done.step_collectives[op]}':>20}" for op in COLLECTIVES)
        print(f"  {c.name:<12}{cells}")


# ---- the pipeline's floor (--floor) ----------------------------------------------------------


def floor_variants(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> dict[str, Compiled]:
    """The pipelined spec twice more, its generated executor altered so that the numbers are
    wrong but the work is what is to be timed: `no sends` runs the schedule's ticks with every
    send replaced by the value sent (no collective over the stage axis); `compute alone` also
    replaces the table by every stage's forward and backward ticks back to back (no bubble)."""
    from dslc.runtime import pipeline as executor
    from dslc.runtime.schedule import schedule_tables

    variants = {}
    send = executor._Executor.send
    for name in ("no sends", "compute alone"):
        run = DslcContender(name, spec_text(dropout=True, pipeline=True), weights, batch)
        module = run.program.module
        if name == "compute alone":
            pipeline = module.PIPELINE
            timeline = " ".join(
                [f"F{m}" for m in range(pipeline.microbatches)] + [f"B{m}" for m in range(pipeline.microbatches)]
            )
            module.PIPELINE = pipeline._replace(table=schedule_tables(*[timeline] * len(module.TIMELINES)))
        # The executor is the runtime's, shared by every program: changed only while these
        # variants trace and compile.
        executor._Executor.send = lambda self, value: (value, value)  # type: ignore[method-assign]
        try:
            variants[name] = run.compile()
        finally:
            executor._Executor.send = send  # type: ignore[method-assign]
    return variants


def report_floor(runs: list[Contender], times: Samples) -> None:
    """The pipelined step's time taken apart: its sends, its bubble, its compute."""
    ticks, run = pipeline_ticks(runs[0]), runs[0]
    assert isinstance(run, DslcContender)
    busy = 2 * run.program.module.PIPELINE.microbatches  # each stage's forward and backward ticks
    rows = (
        ("dslc", f"pipelined ({ticks} ticks)"),
        ("no sends", f"the same {ticks} ticks, no sends"),
        ("compute alone", f"compute alone ({busy} ticks, no bubble, no sends)"),
        ("dslc-nopipe", "unpipelined"),
    )
    print("\nthe pipeline's cost, jitted step, ms: wall median (10th percentile) | process CPU median; / unpipelined")
    flat = [statistics.median(times["dslc-nopipe"][i]) for i in (1, 2)]
    for name, label in rows:
        wall, cpu = sorted(times[name][1]), times[name][2]
        tenth = wall[len(wall) // 10]
        print(
            f"  {label:<46} {statistics.median(wall):7.2f} ({tenth:7.2f}) | {statistics.median(cpu):7.2f};"
            f"  {statistics.median(wall) / flat[0]:.3f} | {statistics.median(cpu) / flat[1]:.3f}"
        )
    wall = {name: statistics.median(times[name][1]) for name, _ in rows}
    print(
        f"  sends {(wall['dslc'] - wall['no sends']) / ticks:+.3f} ms per tick; the bubble's "
        f"{ticks - busy} ticks {wall['no sends'] - wall['compute alone']:+.2f} ms; the floor without sends "
        f"(no sends / unpipelined) {wall['no sends'] / wall['dslc-nopipe']:.3f}"
    )


def pipeline_ticks(run: Contender) -> int:
    """Ticks of the pipelined contender's schedule table."""
    assert isinstance(run, DslcContender)
    return schedule_table(run.program.ir).ticks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps to take the median of")
    parser.add_argument(
        "--floor", action="store_true", help="also time the pipelined step without its sends, and its compute alone"
    )
    args = parser.parse_args()

    # dslc's fresh weights and example batch are everyone's starting point.
    program = dslc.compile(SPEC)
    weights = program.export_weights(program.init(SEED))
    batch = program.example_batch(SEED)
    mesh = jax.make_mesh((2, 4, 2), ("data", "model", "stage"), axis_types=(AxisType.Auto,) * 3)
    print(
        f"{program.ir.name}: {sum(w.size for w in weights.values())} parameters, batch {BATCH}x{SEQ}, "
        f"mesh 2x4x2 (data x model x stage) of {len(jax.devices())} CPU devices"
    )
    check_numerics(contenders(mesh, weights, batch, dropout=False))

    runs = contenders(mesh, weights, batch, dropout=True)
    compiled = {c.name: c.compile() for c in runs}
    extra = floor_variants(weights, batch) if args.floor else {}
    times = time_steps(runs, compiled, args.steps, extra)
    report(runs, compiled, times, args.steps)
    if args.floor:
        report_floor(runs, times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
