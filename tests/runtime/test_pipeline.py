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
from typing import Any

import jax
import numpy as np
import pytest

import dslc
from dslc.lower.hlo import collectives, stalling
from dslc.runtime import pipeline as executor
from dslc.schedules import build, to_json
from tests.conftest import SPECS, compiled

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

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


@pytest.mark.sample(1)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_seed_mlp_pipeline_matches_autodiff(kind: str) -> None:
    assert_matches_autodiff(dslc.compile(_with_schedule((SPECS / "seed_mlp_pipeline.par").read_text(), kind)))


# Where each of the six chunks runs: round the ring twice, or down the stages and back up.
SIX_CHUNK_STAGES = {
    "interleaved-1f1b": [0, 1, 2, 0, 1, 2],
    "zb-v": [0, 1, 2, 2, 1, 0],
    "v-half": [0, 1, 2, 2, 1, 0],
}


@pytest.mark.sample(1)
@pytest.mark.parametrize("kind", sorted(SIX_CHUNK_STAGES))
def test_seed_mlp_two_chunks_per_stage_matches_autodiff(kind: str) -> None:
    # Six chunks of different shapes, two per stage; interleaving needs microbatches in
    # multiples of the 3 stages: 6 microbatches of 4.
    program = dslc.compile(_with_schedule(_seed_mlp_six_chunks(), kind), overrides={"batch": 24})
    assert [c.stage for c in program.ir.chunks] == SIX_CHUNK_STAGES[kind]
    assert_matches_autodiff(program)


@pytest.mark.sample(1)
@pytest.mark.parametrize("kind", ["1f1b", "zb-v"])
def test_sends_as_permutations_match_autodiff(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CPU a tick's send travels as one all-gather over the stage axis (`sends_by_gather`),
    # elsewhere as a permutation each way round the ring: run those here too, on three stages
    # (up and down two permutations), for a ring and for a V (which reads both arrivals).
    text = (SPECS / "seed_mlp_pipeline.par").read_text()
    if kind == "zb-v":
        program = dslc.compile(_with_schedule(_seed_mlp_six_chunks(), kind), overrides={"batch": 24})
    else:
        program = dslc.compile(_with_schedule(text, kind))
    monkeypatch.setattr(executor, "sends_by_gather", lambda: False)
    with jax.set_mesh(program.mesh):
        hlo = program.lower("grads").compile().as_text()
    assert "collective-permute(" in hlo
    assert_matches_autodiff(program)


# gpipe, 1f1b and zb-h1 on one chunk per stage are checked on the seed MLP above (and 1f1b,
# gpt_small's own schedule, against a single-device reference in test_numerics.py).
@pytest.mark.sample(1)
@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v", "v-half"])
def test_gpt_small_with_tensor_parallel_stages_matches_autodiff(kind: str) -> None:
    text = _with_schedule((SPECS / "gpt_small.par").read_text(), kind)
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


# ---- placement: each stage holds its own weights ------------------------------------------------


def _bytes_per_device(arrays: dict[str, jax.Array]) -> dict[int, int]:
    """Bytes of the stored arrays' shards on each device, read from the arrays themselves."""
    held: dict[int, int] = {}
    for value in arrays.values():
        for shard in value.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def _stage_bytes(program: dslc.Program) -> list[int]:
    """Each stage's weight bytes, counted per layer from the chunks it runs."""
    from dslc.ir import nodes as ir

    per_stage = [0] * program.ir.stages
    for chunk in program.ir.chunks:
        layers = ir.counted_layers(chunk.nodes)
        per_stage[chunk.stage] += sum(w.type.nbytes * times for layer, times in layers for w in layer.weights)
    return per_stage


def test_each_device_holds_only_its_stages_weights() -> None:
    # Unequal stages, no data or tensor axis: a device holds exactly its own stage's weights,
    # and the stages written one by one are stored as per-stage rows of one array each, so
    # every device holds the largest stage's size (here stage 0's: fc1 and fc2 are the
    # largest of their rows).
    mlp = compiled(SPECS / "seed_mlp_pipeline.par")
    held = _bytes_per_device(mlp.model.arrays())
    assert len(held) == 3
    assert set(held.values()) == {max(_stage_bytes(mlp.program))}
    # A repeat split over 4 stages, the embedding and head split over them between steps:
    # every device holds a quarter of the model, nothing more.
    gpt = compiled(SPECS / "gpt_small.par", mesh="1x1x4", overrides={"seq": 16})
    total = sum(4 * int(np.prod(shape)) for shape in gpt.program.weight_shapes().values())  # all f32
    assert set(_bytes_per_device(gpt.model.arrays()).values()) == {total // 4}


def test_training_step_sends_no_weight_sized_value_over_the_stage_axis() -> None:
    # On a mesh whose only axis of size > 1 is the stage axis, every all-reduce in the compiled
    # step is over it. What may cross it: the loss and the counts of its microbatches, and the
    # global gradient norm's partial sums (gradient clipping) — a handful of scalars. A weight's
    # gradient summed over stages would be at least as large as the smallest weight.
    gpt = compiled(SPECS / "gpt_small.par", mesh="1x1x4", overrides={"seq": 16})
    with jax.set_mesh(gpt.program.mesh):
        hlo = gpt.program.lower("train").compile().as_text()
    smallest = min(int(np.prod(shape)) for shape in gpt.program.weight_shapes().values())
    sizes = []
    for line in hlo.splitlines():
        if re.search(r"\sall-reduce(?:-start)?\(", line):
            result = line.split("=", 1)[1].split("all-reduce", 1)[0]
            shapes = re.findall(r"\[([\d,]*)\]", result)
            sizes.append(max(int(np.prod([int(d) for d in s.split(",") if d] or [1])) for s in shapes))
    assert sizes, "the step has no all-reduce at all: the loss is not summed over the stages"
    assert max(sizes) < smallest, sorted(sizes)[-5:]


def _stalling(program: dslc.Program) -> tuple[list[Any], list[Any]]:
    """The compiled gradient step's collectives in the executor's per-stage branches, and
    those of them that would wait for another stage's devices."""
    hlo = program.lower("grads").compile().as_text()
    inside = [c for c in collectives(hlo) if f"/{executor.STAGE_BRANCHES}/" in c.op_name]
    mesh = program.mesh
    return inside, stalling(inside, mesh.axis_names, tuple(mesh.shape.values()), program.ir.pipeline.axis)


def test_zero3_gathers_a_stage_row_before_slicing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # ZeRO-3 splits seed_mlp_pipeline's per-stage arrays (rows of 784 x 512, 512 x 256 and 256 x
    # 128, padded to the largest) over `data` along the padded dimension. A chunk's slice of
    # its row crossed the pieces; XLA moved them by collective-permutes naming every device,
    # inside the switch where each stage runs its own chunk, and the step hung for 40 s and
    # aborted. The executor gathers over `data` first: only all-gathers within a stage remain.
    text = (
        (SPECS / "seed_mlp_pipeline.par")
        .read_text()
        .replace("pipeline stage {", "train {\n  zero 3\n}\n\npipeline stage {")
    )
    program = dslc.compile(text, "2x3", {"batch": 64})
    inside, stalls = _stalling(program)
    assert "all-gather" in {c.kind for c in inside}  # ZeRO-3's gathers, within a stage
    assert not stalls, [(c.kind, c.groups) for c in stalls]
    # Slicing without the gather is what hung: the reader finds those permutes.
    monkeypatch.setattr(executor, "_gathered", lambda array, sharding, dims: array)
    _, before = _stalling(dslc.compile(text, "2x3", {"batch": 64}))
    assert {c.kind for c in before} == {"collective-permute"}


def test_the_pipelined_step_does_the_flops_of_the_unpipelined_one() -> None:
    """The spec's checkpointing alone decides recomputation: without it the pipeline keeps
    each chunk's residuals from its forward tick to its backward tick and reruns nothing."""
    from dslc.ir.schedule import schedule_of
    from tests.jaxpr_flops import dot_flops

    def flops(checkpoint: str) -> tuple[float, float]:
        text = (SPECS / "gpt_small.par").read_text().replace("checkpoint selective(attn)", checkpoint)
        program = dslc.compile(text, overrides={"seq": 16})
        assert program.ir.pipeline is not None
        with jax.set_mesh(program.mesh):
            unpipelined = jax.jit(jax.value_and_grad(program.module.loss)).trace(*program.abstract_arguments())
        ticks, microbatches = schedule_of(program.ir).table().ticks, program.ir.pipeline.microbatches
        return dot_flops(program.trace("grads").jaxpr, ticks=ticks, microbatches=microbatches), dot_flops(
            unpipelined.jaxpr
        )

    pipelined, unpipelined = flops("")
    # Issue target 1.05; measured 1.000 (the same matrix multiplies, in another order).
    assert pipelined <= 1.05 * unpipelined, pipelined / unpipelined
    # The count sees recomputation: `checkpoint full` reruns every block's forward in its
    # backward, pipelined or not (measured 1.21x the FLOPs of no checkpointing).
    recomputed, recomputed_unpipelined = flops("checkpoint full")
    assert recomputed >= 1.15 * pipelined
    assert recomputed <= 1.05 * recomputed_unpipelined
