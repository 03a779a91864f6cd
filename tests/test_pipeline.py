"""The pipeline executor runs every schedule with the numbers of training without a pipeline,
and holds the activations its schedule says it holds.

The non-pipelined reference is the same program differentiated by plain autodiff on the same
mesh (the generated module's `loss` runs the chunks one after another, with no pipeline);
test_numerics.py separately compares the default schedules against an independent
single-device reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import dslc
from dslc.schedules import build, to_json
from tests.conftest import SPECS

# f32 on a CPU mesh: the pipeline sums the per-microbatch gradients in another order than one
# backward over the whole batch. Measured: max relative error 6.3e-7 (seed MLP), 9.8e-7
# (gpt_small); 1e-5 leaves a margin of ten without hiding a wrong microbatch or chunk, whose
# error would be of order one.
RTOL = 1e-5


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def assert_matches_autodiff(program: dslc.Program) -> None:
    assert program.ir.pipelined
    model = program.init(0)
    batch = program.example_batch(0)
    got_loss, got = program.value_and_grad(model, batch)
    with jax.set_mesh(program.mesh):
        want_loss, want = jax.jit(jax.value_and_grad(program.module.loss))(model.arrays(), program.place(batch))
    assert float(got_loss) == pytest.approx(float(want_loss), rel=RTOL)
    assert set(got) == set(want)
    for name in want:
        assert relative_error(np.asarray(got[name]), np.asarray(want[name])) < RTOL, name


def _with_schedule(text: str, kind: str) -> str:
    return re.sub(r"schedule \S+", f"schedule {kind}", text)


def _seed_mlp_six_chunks() -> str:
    """The seed MLP with one linear per chunk: 6 chunks, 2 per device on 3 devices."""
    text = (SPECS / "seed_mlp_pipeline.par").read_text()
    body = "\n".join(
        f"  stage {{\n    fc{i}: linear({a}, {b})\n"
        + ("    relu()\n" if i < 6 else "    loss: cross_entropy(labels)\n")
        + "  }"
        for i, (a, b) in enumerate([(784, 512), (512, 512), (512, 256), (256, 256), (256, 128), (128, 10)], start=1)
    )
    text = re.sub(r"forward\(images\) \{.*?\n\}\n", "forward(images) {\n" + body + "\n}\n", text, flags=re.S)
    return text.replace("microbatches 4", "microbatches 6\n  virtual 2")


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_seed_mlp_pipeline_matches_autodiff(kind: str) -> None:
    assert_matches_autodiff(dslc.compile(_with_schedule((SPECS / "seed_mlp_pipeline.par").read_text(), kind)))


def test_seed_mlp_interleaved_matches_autodiff() -> None:
    # Interleaving needs microbatches in multiples of the 3 stages: 6 microbatches of 4.
    program = dslc.compile(_with_schedule(_seed_mlp_six_chunks(), "interleaved-1f1b"), overrides={"batch": 24})
    assert [c.stage for c in program.ir.chunks] == [0, 1, 2, 0, 1, 2]
    assert_matches_autodiff(program)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_gpt_small_with_tensor_parallel_stages_matches_autodiff(kind: str) -> None:
    text = _with_schedule((SPECS / "gpt_small.par").read_text(), kind)
    if kind == "interleaved-1f1b":
        text = text.replace("microbatches 4", "microbatches 4\n  virtual 2")
    # Default mesh 2x4x2: data x Megatron tensor parallel inside each of 2 stages. A shorter
    # sequence keeps the compile affordable on CI; the structure is unchanged.
    program = dslc.compile(text, overrides={"seq": 16})
    assert program.mesh.shape == {"data": 2, "model": 4, "stage": 2}
    assert_matches_autodiff(program)


def _temp_bytes(kind: str, microbatches: int) -> int:
    """Compiled per-device temp memory of a gradient step, one 8-row microbatch at a time."""
    text = _with_schedule((SPECS / "seed_mlp_pipeline.par").read_text(), kind).replace(
        "microbatches 4", f"microbatches {microbatches}"
    )
    return dslc.compile(text, overrides={"batch": 8 * microbatches}).compiled_memory("grads").temporaries


def test_1f1b_holds_fewer_activations_than_gpipe_and_does_not_grow_with_microbatches() -> None:
    gpipe = {m: _temp_bytes("gpipe", m) for m in (8, 16)}
    one_f_one_b = {m: _temp_bytes("1f1b", m) for m in (8, 16)}
    assert one_f_one_b[8] < gpipe[8]
    # Doubling M here doubles the batch, and the microbatched copy of the inputs (f32
    # images and i32 labels) is itself temporary: subtract it to see what the schedule keeps.
    more_inputs = 8 * 8 * (784 * 4 + 4)
    gpipe_stash = gpipe[16] - gpipe[8] - more_inputs
    one_f_one_b_stash = one_f_one_b[16] - one_f_one_b[8] - more_inputs
    # GPipe keeps every microbatch's input until its backward: 8 more 8x784 f32 tensors at least.
    assert gpipe_stash >= 8 * 8 * 784 * 4
    # 1F1B keeps at most one per stage (3), whatever M is.
    assert one_f_one_b_stash < 4096


def test_schedule_is_one_word_on_the_command_line() -> None:
    text = (SPECS / "seed_mlp_pipeline.par").read_text()
    assert "# The gpipe schedule" in dslc.compile(text).source
    program = dslc.compile(text, schedule="zb-h1")
    assert program.ir.pipeline is not None and program.ir.pipeline.schedule == "zb-h1"
    assert "# The zb-h1 schedule" in program.source
    with pytest.raises(ValueError, match="did you mean 'zb-h1'"):
        dslc.compile(text, schedule="zb-h2")
    with pytest.raises(dslc.CompileError, match="E022"):
        dslc.compile(text, schedule="interleaved-1f1b")  # needs virtual >= 2


def test_executor_speaks_the_planners_op_codes() -> None:
    # The executor and the kernel that makes its tables each spell the op codes; they must agree.
    from dslc.kernels import pipeline as executor
    from dslc.kernels import schedule

    names = ("IDLE", "FORWARD", "BACKWARD", "INPUT_GRAD", "WEIGHT_GRAD", "TABLE_ENTRIES", "OTHER_DIRECTIONS")
    assert [getattr(executor, n) for n in names] == [getattr(schedule, n) for n in names]


def test_a_table_of_ones_own_runs_with_the_numbers_of_autodiff(tmp_path: Path) -> None:
    """A user's table from a file, not a built-in one: zb-h1's order with every stage's weight
    gradients moved after all its other actions. The executor runs what the file says."""
    spec = SPECS / "seed_mlp_pipeline.par"  # 3 stages, 4 microbatches
    table = json.loads(json.dumps(to_json(build("zb-h1", 3, 4))))
    for row in table["actions"]:
        last = max(a["tick"] for a in row if a["op"] != "W")
        weight_grads = [a for a in row if a["op"] == "W"]
        for i, action in enumerate(weight_grads, start=1):
            action["tick"] = last + i
        row[:] = [a for a in row if a["op"] != "W"] + weight_grads
    table |= {"kind": "deferred", "ticks": 1 + max(a["tick"] for row in table["actions"] for a in row)}
    path = tmp_path / "deferred.json"
    path.write_text(json.dumps(table))
    program = dslc.compile(spec, schedule=str(path))
    assert program.ir.pipeline is not None and program.ir.pipeline.schedule == "deferred"
    assert_matches_autodiff(program)
