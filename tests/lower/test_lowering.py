"""Compiled programs: collectives, ZeRO/FSDP state placement, checkpointing, precision, CLI.

Numerics against an independent reference live in test_numerics.py; this file checks that
the compiled programs are shaped the way the spec and the IR say.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dslc
from dslc.ir import nodes as ir
from tests.conftest import SPECS, own_mesh_env

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

SEQUENCE_PARALLEL = """
model sp_layer
mesh data=2, model=4
input x: f32[4 @ data, 16 @ model, 64]   # tokens split over `model` between blocks
input y: f32[4 @ data, 16 @ model, 64]
forward(x) {
  residual {
    ln1: layernorm(64)
    attn: attention(64, 4) shard q[_, model], k[_, model], v[_, model], o[model, _]
    layout [data, model, _]
  }
  residual {
    ln2: layernorm(64)
    up: linear(64, 256) shard kernel[_, model], bias[model]
    gelu()
    down: linear(256, 64) shard kernel[model, _]
    layout [data, model, _]
  }
  loss: mse(y)
}
"""


def hlo_collectives(text: str) -> dict[str, int]:
    """Collective ops in compiled HLO text (both the sync and the async `-start` form)."""
    counts = {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


def ir_forward_collectives(program: ir.Program) -> dict[str, int]:
    """What the IR predicts for the compiled forward pass.

    A repeat compiles to one loop body, so its collectives appear once in the HLO text, as
    they do once in the IR. XLA on CPU has no reduce-scatter pass: a reduce-scatter is emitted
    as an all-reduce followed by a slice (see the project's field notes), so it is counted as
    one.
    """
    counts: collections.Counter[str] = collections.Counter()
    for node in ir.walk(program.body):
        for c in getattr(node, "collectives", ()):
            counts["all-reduce" if c.kind == "reduce-scatter" else c.kind] += 1
    return dict(counts)


def compiled_forward(program: dslc.Program) -> str:
    return program.lower("forward").compile().as_text()


def test_megatron_layer_forward_has_exactly_two_all_reduces() -> None:
    program = dslc.compile(SPECS / "seed_tp_layer.par")
    assert hlo_collectives(compiled_forward(program)) == {"all-reduce": 2}


def test_sequence_parallel_block_is_one_all_gather_and_one_reduce_scatter_per_block() -> None:
    program = dslc.compile(SEQUENCE_PARALLEL)
    kinds = [c.kind for layer in ir.all_layers(program.ir) for c in layer.collectives]
    assert kinds == ["all-gather", "reduce-scatter", "all-gather", "reduce-scatter"]
    # On CPU each reduce-scatter compiles to an all-reduce + slice; nothing else is added.
    assert hlo_collectives(compiled_forward(program)) == {"all-gather": 2, "all-reduce": 2}


# Pipelined specs are left out: their forward (evaluation, no pipeline) runs the chunks one
# after another on every device, moving each stage's weights to where it computes.
@pytest.mark.sample(1)
@pytest.mark.parametrize("spec", ["tiny.par", "llama_small.par", "seed_tp_layer.par"])
def test_compiled_forward_collectives_are_the_ones_the_ir_predicts(spec: str) -> None:
    program = dslc.compile(SPECS / spec)
    assert hlo_collectives(compiled_forward(program)) == ir_forward_collectives(program.ir)


# ---- ZeRO / FSDP --------------------------------------------------------------------------------


def _tiny_with(train_line: str) -> str:
    return (SPECS / "tiny.par").read_text().replace("train {", "train {\n  " + train_line)


def _local_shape(array: jax.Array) -> tuple[int, ...]:
    return tuple(array.addressable_shards[0].data.shape)


@pytest.fixture(scope="module")
def zero_runs() -> dict[str, dict[str, object]]:
    """For each ZeRO setting: shardings and per-device shapes of one weight's state, and
    the loss over a few training steps."""
    out: dict[str, dict[str, object]] = {}
    for setting in ("zero 0", "zero 1", "zero 2", "zero 3", "fsdp data"):
        program = dslc.compile(_tiny_with(setting))
        model = program.init(0)
        state = program.init_optimizer(model)
        batch = program.example_batch(0)
        name = "layers.*.up.kernel"  # 2 layers of (64, 256), split over `model` as (None, model)
        param = model.params[name][...]
        mu = next(
            leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state) if name in jax.tree_util.keystr(path)
        )
        grads = program.stored_grads(model, batch)[name]
        out[setting] = {
            "param": (param.sharding.spec, _local_shape(param)),
            "opt": (mu.sharding.spec, _local_shape(mu)),
            "grad": (grads.sharding.spec, _local_shape(grads)),
        }
        # Training steps donate the old parameter and state buffers: read them first.
        losses = []
        for step in range(4):
            state, loss = program.train_step(model, state, batch, step)
            losses.append(loss)
        out[setting]["losses"] = losses
    return out


def test_zero_stages_split_optimizer_state_then_gradients_then_parameters(
    zero_runs: dict[str, dict[str, object]],
) -> None:
    P = jax.sharding.PartitionSpec
    # The layers' own dimension is split last: each device keeps a slice of every layer.
    whole, split = (P(None, None, "model"), (2, 64, 128)), (P(None, "data", "model"), (2, 32, 128))
    expected = {
        "zero 0": (whole, whole, whole),
        "zero 1": (whole, split, whole),
        "zero 2": (whole, split, split),
        "zero 3": (split, split, split),
        "fsdp data": (split, split, split),
    }
    for setting, (param, opt, grad) in expected.items():
        run = zero_runs[setting]
        assert (run["param"], run["opt"], run["grad"]) == (param, opt, grad), setting


def test_zero_stages_do_not_change_the_training_trajectory(zero_runs: dict[str, dict[str, object]]) -> None:
    reference = np.array(zero_runs["zero 0"]["losses"])
    assert reference[-1] < reference[0], "the loss must fall over the steps"
    for setting, run in zero_runs.items():
        # Only the placement of state changes; sums over devices may reorder (f32 rounding).
        np.testing.assert_allclose(run["losses"], reference, rtol=1e-5, err_msg=setting)


# ---- activation checkpointing and precision -----------------------------------------------------


def _temp_bytes(source: str) -> int:
    return dslc.compile(source).compiled_memory("grads").temporaries


def test_checkpointing_lowers_compiled_temp_memory() -> None:
    base = (SPECS / "tiny.par").read_text().replace("const seq = 32", "const seq = 64").replace("repeat 2", "repeat 4")
    header = "block decoder(d, heads, ffn)"
    none = _temp_bytes(base.replace(header, header + " checkpoint none"))
    full = _temp_bytes(base.replace(header, header + " checkpoint full"))
    selective = _temp_bytes(base.replace(header, header + " checkpoint selective(attn)"))
    # Without checkpointing the backward keeps every block's activations (attention scores
    # included); with it only each block's input survives the forward pass.
    assert full < none / 2
    assert selective < none / 2


def test_mixed_precision_computes_in_bf16_and_keeps_f32_parameters() -> None:
    program = dslc.compile(SPECS / "llama_small.par")
    assert program.ir.train.compute_dtype == "bf16"
    model = program.init(0)
    assert all(v.dtype == np.float32 for v in model.arrays().values())
    # The lowered program (before XLA's CPU passes, which widen bf16 matmuls to f32 because
    # this CPU has no bf16 units) does every matrix product in bf16.
    lowered = program.lower("forward").as_text()
    dots = [line for line in lowered.splitlines() if "dot_general" in line]
    assert dots and all(re.search(r"-> tensor<[0-9x]*xbf16>", line) for line in dots), dots[:2]
    batch = program.example_batch(0)
    full = dslc.compile((SPECS / "llama_small.par").read_text().replace("compute_dtype bf16", "compute_dtype f32"))
    f32_model = full.init(0)
    # bf16 keeps 8 bits of mantissa: a loss near 6 agrees to a few parts in a thousand.
    assert abs(float(program.loss(model, batch)) - float(full.loss(f32_model, batch))) < 0.05


def test_dropout_is_off_in_forward_and_on_in_training_steps() -> None:
    program = dslc.compile(SPECS / "gpt_small.par")  # dropout(0.1) in every block
    model = program.init(0)
    batch = program.example_batch(0)
    assert float(program.loss(model, batch)) == float(program.loss(model, batch))
    state = program.init_optimizer(model)
    before = float(program.loss(model, batch))
    # Step 0 has learning rate 0 (warm-up), so parameters do not move: the training loss
    # differs from the evaluation loss only through dropout.
    _, train_loss = program.train_step(model, state, batch, 0)
    assert train_loss != pytest.approx(before, abs=1e-6)
    assert float(program.loss(model, batch)) == pytest.approx(before, abs=1e-6)


# ---- CLI: init and run in a fresh process ---------------------------------------------------------


def _dslc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = own_mesh_env()
    return subprocess.run(
        [sys.executable, "-m", "dslc.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_cli_init_and_run_simulate_the_mesh_and_match_the_python_api(tmp_path: Path) -> None:
    spec = str(SPECS / "tiny.par")
    init = _dslc("init", spec, "--seed", "5", "-o", "w.npz", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    program = dslc.compile(SPECS / "tiny.par")
    batch = program.example_batch(1)
    np.savez(tmp_path / "x.npz", **batch)
    run = _dslc("run", spec, "--weights", "w.npz", "--inputs", "x.npz", "-o", "y.npz", "--grads", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    model = program.init(5)
    with np.load(tmp_path / "w.npz") as weights:
        for name, value in program.export_weights(model).items():
            np.testing.assert_array_equal(weights[name], value)
    with np.load(tmp_path / "y.npz") as out:
        np.testing.assert_allclose(out["output"], np.asarray(program.forward(model, batch)), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["loss"], float(program.loss(model, batch)), rtol=1e-6)
        grads = program.grads(model, batch)
        assert {k.removeprefix("grad/") for k in out.files if k.startswith("grad/")} == set(grads)


BF16_LINEAR = """model half
mesh data=2
input x: f32[4 @ data, 8]
input y: f32[4 @ data, 8]
forward(x) {
  fc: linear(8, 8)
  loss: mse(y)
}
train {
  param_dtype bf16
  compute_dtype bf16
}
"""


def test_cli_writes_bf16_results_and_weights_as_float32_numpy_reads(tmp_path: Path) -> None:
    """numpy has no bfloat16: such an array in an .npz reads as raw `|V2` bytes nothing can
    subtract. `init` and `run` write float32 (exactly the bf16 values) and read it back."""
    (tmp_path / "half.par").write_text(BF16_LINEAR)
    assert _dslc("init", "half.par", "-o", "w.npz", cwd=tmp_path).returncode == 0
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "x.npz", x=rng.standard_normal((4, 8), np.float32), y=rng.standard_normal((4, 8), np.float32))
    run = _dslc("run", "half.par", "--weights", "w.npz", "--inputs", "x.npz", "-o", "y.npz", "--grads", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    program = dslc.compile(tmp_path / "half.par")
    model = program.init(0)
    with np.load(tmp_path / "w.npz") as weights:
        assert weights["fc.kernel"].dtype == np.float32
        program.import_weights(model, {name: weights[name] for name in weights.files})
    with np.load(tmp_path / "x.npz") as inputs:
        batch = {name: inputs[name] for name in inputs.files}
    want = np.asarray(program.forward(model, batch))
    assert want.dtype == jax.numpy.bfloat16
    with np.load(tmp_path / "y.npz") as out:
        for name in ("output", "grad/fc.kernel"):
            assert out[name].dtype == np.float32, name
        np.testing.assert_array_equal(out["output"] - want.astype(np.float32), 0)


def test_cli_run_rejects_weights_of_another_spec_without_writing(tmp_path: Path) -> None:
    assert _dslc("init", str(SPECS / "tiny.par"), "-o", "w.npz", cwd=tmp_path).returncode == 0
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 128, 768), np.float32))  # its declared input
    run = _dslc(
        "run", str(SPECS / "seed_tp_layer.par"), "--weights", "w.npz", "--inputs", "x.npz", "-o", "y.npz", cwd=tmp_path
    )
    assert run.returncode == 1
    assert "cannot load weights" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "y.npz").exists()
