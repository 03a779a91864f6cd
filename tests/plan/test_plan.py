"""`dslc plan`: the planner's figures against XLA's, against the published formulas, and the CLI.

Accuracy: for every spec at its default mesh, the planner's bytes per device for the gradient
step are compared with XLA's compiled memory analysis (argument + output + temp - alias; the
field notes, section 6, explain why not the peak on CPU). The steps compile on CPU host
devices, so they are planned for that backend (`backend="cpu"`: what XLA's CPU backend alone
holds, `dslc.plan.memory.cpu_widening`). seed_hybrid_3d is planned and compiled with
layers=4, seq=64, hidden=128: at full size it is too large to compile on CI.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dslc
from bench.bench_plan_accuracy import RESIDUAL_MLP, SECOND_MESH, STATE_SETTINGS, option_cases, residual_mlp, with_master
from dslc import cli
from dslc.ir.schedule import pipeline_figures
from dslc.plan import Plan, plan
from tests.conftest import ROOT, SPECS, TEST_SPECS, compiled

TOLERANCE = 0.10
# Specs too large to compile on CI at their declared sizes, made small on their own meshes
# (gpt2 and llama at gpt_small's sizes: measured 1.011 and 1.023).
SMALL = {
    "seed_hybrid_3d": {"layers": 4, "seq": 64, "hidden": 128},
    "gpt2": {"vocab": 128, "positions": 32, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 16},
    "gpt_neox": {"vocab": 128, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 16},
    "llama": {"vocab": 128, "d": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "layers": 4, "seq": 32, "batch": 16},
    "gemma2": {
        "vocab": 128,
        "d": 64,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn": 176,
        "layers": 4,
        "window": 16,
        "seq": 32,
        "batch": 16,
    },
    "t5": {
        "vocab": 128,
        "d": 64,
        "heads": 4,
        "head_dim": 16,
        "ffn": 128,
        "layers": 4,
        "seq": 32,
        "target_seq": 16,
        "batch": 16,
        "buckets": 8,
        "max_distance": 16,
    },
}
ACCURACY_SPECS = [
    "tiny",
    "seed_mlp_pipeline",
    "gpt_small",
    "seed_hybrid_3d",
    "moe_small",
    "gpt2",
    "gpt_neox",
    "llama_small",
    "llama",
    "long_context",
    "mixtral",
    "qwen3_moe",
    "vit",
    "gemma2",
    "t5",
    # A single layer with a data axis: XLA's CPU backend holds its gradients twice at their sum
    # (planned 0.857 of XLA before `cpu_summed_twice`).
    "seed_tp_layer",
    # Tensor-parallel experts whose recomputed working set is made in f32 on CPU (planned 0.846
    # before the working set of a widened recompute was widened too).
    "qwen2_moe",
]
# Specs the planner still misses by more than the tolerance, with the gradient step's planned
# / XLA ratio measured by bench/bench_plan_accuracy.py and what XLA holds that the model
# misses (docs/plan.md, "Known gaps"): none at present.
KNOWN_GAPS: dict[str, float] = {}
# What the tests compile on.
BACKEND = "cpu"


def overrides(name: str) -> dict[str, int] | None:
    return SMALL.get(name)


def planned(name: str, **kwargs: Any) -> Plan:
    analysis = dslc.analyze(SPECS / f"{name}.par", overrides=overrides(name), **kwargs)
    assert analysis.ok and analysis.program is not None
    return plan(analysis.program, backend=BACKEND)


def test_every_spec_is_measured() -> None:
    assert sorted([*ACCURACY_SPECS, *KNOWN_GAPS, "gpt3_175b"]) == sorted(p.stem for p in SPECS.glob("*.par"))


# ---- accuracy against XLA ---------------------------------------------------------------------


@pytest.mark.sample(2)
@pytest.mark.parametrize("name", ACCURACY_SPECS)
def test_gradient_step_memory_within_tolerance_of_xla(name: str) -> None:
    measured = compiled(SPECS / f"{name}.par", overrides=overrides(name)).program.compiled_memory("grads").total
    predicted = planned(name).memory.grads_step
    ratio = predicted / measured
    assert abs(ratio - 1) <= TOLERANCE, f"{name}: planned {predicted:,} B, XLA {measured:,} B, ratio {ratio:.3f}"


# Each pipelined spec is planned on a second mesh too (bench_plan_accuracy.py's SECOND_MESH,
# another stage count); a compile each costs several seconds, so the test holds the one that
# was outside the tolerance there (gpt_small on 2x2x4 planned 1.175 of XLA before a selective
# block's recompute was counted run by run); the bench prints the others.
@pytest.mark.parametrize("name", ["gpt_small"])
def test_gradient_step_memory_on_second_mesh_within_tolerance_of_xla(name: str) -> None:
    mesh = SECOND_MESH[name]
    measured = compiled(SPECS / f"{name}.par", mesh=mesh, overrides=overrides(name)).program
    predicted = planned(name, mesh=mesh).memory.grads_step
    ratio = predicted / measured.compiled_memory("grads").total
    assert abs(ratio - 1) <= TOLERANCE, f"{name} on {mesh}: ratio {ratio:.3f}"


@pytest.mark.parametrize("name", ["tiny", "seed_mlp_pipeline"])
def test_train_step_memory_within_tolerance_of_xla(name: str) -> None:
    """The whole step (optimizer state included) for one plain and one pipelined spec; the
    other specs' steps agree as well (docs/plan.md) but cost a compile each."""
    ratio = planned(name).memory.total / compiled(SPECS / f"{name}.par").program.compiled_memory("train").total
    assert abs(ratio - 1) <= TOLERANCE, f"{name}: ratio {ratio:.3f}"


# The accuracy table's repeated-block MLP, its weights dominating the step, under each way of
# splitting the training state: ZeRO 1 sums its gradients by hand at the step's end, ZeRO 3
# and FSDP gather each layer's weights inside the scan (issue 16: these were planned 3x off).
# Smaller than the table's, to compile in a second or two.
MLP_SIZES = {"d": 128, "n_layers": 4, "batch": 32}


@pytest.mark.sample(3)
@pytest.mark.parametrize("checkpoint", ["full", "none"])
@pytest.mark.parametrize("state", STATE_SETTINGS)
def test_training_state_splits_planned_within_tolerance_of_xla(state: str, checkpoint: str) -> None:
    """Both steps: the gradient step holds a scan step's gathered weights and gradients, the
    training step the optimizer's update besides; with its blocks checkpointed or not."""
    source = residual_mlp(state, checkpoint)
    analysis = dslc.analyze(source, overrides=MLP_SIZES)
    assert analysis.ok and analysis.program is not None
    memory, program = plan(analysis.program, backend=BACKEND).memory, compiled(source, overrides=MLP_SIZES).program
    for step, predicted in (("grads", memory.grads_step), ("train", memory.total)):
        measured = program.compiled_memory(step).total  # type: ignore[arg-type]
        ratio = predicted / measured
        assert abs(ratio - 1) <= TOLERANCE, f"{state}, {step}: planned {predicted:,} B, XLA {measured:,} B, {ratio:.3f}"


# Issue 17's options on repeated blocks (bench_plan_accuracy.py's last rows): gpt_small
# (pipelined) and llama_small with 16-bit parameters and an f32 master copy, llama_small's
# attention blocks with `checkpoint core_attention`. Before the CPU backend's f32 copies were
# planned (`cpu_widening`), their gradient steps planned 0.773, 0.689 and 0.726 of XLA's;
# gpt_small's planned 0.897 before a widened recompute's working set was widened too.
@pytest.mark.sample(1)
@pytest.mark.parametrize("case", option_cases()[0:3], ids=lambda c: c.name)
def test_master_copy_and_core_attention_planned_within_tolerance_of_xla(case: Any) -> None:
    analysis = dslc.analyze(case.source)
    assert analysis.ok and analysis.program is not None
    predicted = plan(analysis.program, backend=BACKEND).memory.grads_step
    measured = compiled(case.source).program.compiled_memory("grads").total
    ratio = predicted / measured
    assert abs(ratio - 1) <= TOLERANCE, f"{case.name}: planned {predicted:,} B, XLA {measured:,} B, {ratio:.3f}"


def test_master_copy_training_step_of_gpt_small_planned_within_tolerance_of_xla() -> None:
    """gpt_small with the master copy, the training step: its backward ticks rerun the blocks'
    dropouts and draw their random bits again (`cpu_random_bits`); before they were planned,
    it planned 0.890 of XLA's figure."""
    case = option_cases()[0]
    analysis = dslc.analyze(case.source)
    assert analysis.ok and analysis.program is not None
    predicted = plan(analysis.program, backend=BACKEND).memory.total
    measured = compiled(case.source).program.compiled_memory("train").total
    ratio = predicted / measured
    assert abs(ratio - 1) <= TOLERANCE, f"{case.name}: planned {predicted:,} B, XLA {measured:,} B, {ratio:.3f}"


def test_master_copy_of_the_residual_mlp_planned_within_tolerance_of_xla() -> None:
    """The repeated-block MLP with the master copy (ZeRO 1), both steps: XLA's CPU backend
    holds an f32 copy of the 16-bit stacked weights (before it was planned, the gradient step
    planned 0.604 of XLA's figure at the table's sizes), and the training step makes the
    gradients in the donated weights' buffers."""
    source = with_master(RESIDUAL_MLP.replace("SETTING", "zero 1"))
    analysis = dslc.analyze(source, overrides=MLP_SIZES)
    assert analysis.ok and analysis.program is not None
    memory, program = plan(analysis.program, backend=BACKEND).memory, compiled(source, overrides=MLP_SIZES).program
    for step, predicted in (("grads", memory.grads_step), ("train", memory.total)):
        ratio = predicted / program.compiled_memory(step).total  # type: ignore[arg-type]
        assert abs(ratio - 1) <= TOLERANCE, f"{step}: ratio {ratio:.3f}"


def test_cpu_backend_terms_are_planned_only_for_cpu() -> None:
    """The CPU backend's f32 copies count only when the plan targets that backend, and then
    as the residual MLP's sizes say: per layer, up d x 4d + 4d and down 4d x d + d in bf16,
    copied in f32 whole (n_layers of them) and one layer's slice besides."""
    analysis = dslc.analyze(with_master(RESIDUAL_MLP.replace("SETTING", "zero 1")), overrides=MLP_SIZES)
    assert analysis.program is not None
    accelerator, cpu = plan(analysis.program).memory, plan(analysis.program, backend=BACKEND).memory
    d, layers = MLP_SIZES["d"], MLP_SIZES["n_layers"]
    widened = 4 * (layers + 1) * (8 * d * d + 5 * d)
    assert (
        dict(cpu.details)["XLA's CPU backend: an f32 copy of each scan's 16-bit stacked weights, and of one layer's"]
        == widened
    )
    assert not any("CPU" in what for what, _ in accelerator.details)
    assert plan(analysis.program, backend="gpu").memory == accelerator
    f32 = dslc.analyze(RESIDUAL_MLP.replace("SETTING", "zero 1"), overrides=MLP_SIZES).program
    assert f32 is not None
    assert plan(f32, backend=BACKEND).memory.grads_step == plan(f32).memory.grads_step


def test_cpu_gradient_sum_outside_a_scan_is_held_twice() -> None:
    """seed_tp_layer's gradients (a single layer, no scan) are summed over `data` after its
    backward pass: on CPU the step's peak is then the parameters, the inputs and the gradients
    twice, larger than its backward's own (XLA: argument 7,882,752 + output 7,096,428 + temp
    7,096,552 bytes); an accelerator's all-reduce runs in place."""
    analysis = dslc.analyze(SPECS / "seed_tp_layer.par")
    assert analysis.program is not None
    cpu, accelerator = plan(analysis.program, backend=BACKEND).memory, plan(analysis.program).memory
    assert cpu.grads_step == cpu.params + 2 * cpu.grads + cpu.inputs
    assert accelerator.grads_step == cpu.params + cpu.grads + cpu.inputs + cpu.activations
    assert accelerator.temporaries == 0 < cpu.temporaries


def test_cpu_training_step_draws_rerun_dropouts_random_bits() -> None:
    """gpt_small's blocks are checkpointed (`selective(attn)`): a backward tick reruns their
    dropouts, and the training step draws their masks' random bits again, four 32-bit words
    an element of one microbatch's [2, 32, 64] on CPU (at its peak XLA holds the two counters
    and threefry's loop words, u32[2,32,64] each). The gradient step runs without dropout, a
    block that is not rerun keeps its masks, and an accelerator fuses threefry into the mask:
    none of them draws any."""
    source = (SPECS / "gpt_small.par").read_text()
    program = dslc.analyze(source).program
    assert program is not None
    cpu, accelerator = plan(program, backend=BACKEND).memory, plan(program).memory
    assert cpu.random_bits == 4 * 4 * 2 * 32 * 64
    assert cpu.total == accelerator.total + cpu.random_bits and cpu.grads_step == accelerator.grads_step
    assert accelerator.random_bits == 0
    kept = dslc.analyze(source.replace("checkpoint selective(attn)", "checkpoint none")).program
    assert kept is not None
    assert plan(kept, backend=BACKEND).memory.random_bits == 0


# ---- GPT-3 175B on paper ----------------------------------------------------------------------

GPT3 = SPECS / "gpt3_175b.par"


@pytest.fixture(scope="module")
def gpt3() -> tuple[Any, Plan]:
    analysis = dslc.analyze(GPT3)
    assert analysis.program is not None
    return analysis.program, plan(analysis.program)


def test_gpt3_checks_clean() -> None:
    assert dslc.check(GPT3) == []


def test_gpt3_parameters_match_megatron_formula(gpt3: tuple[Any, Plan]) -> None:
    """Narayanan et al. 2021, section 5.1: P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)), i.e.
    12lh^2 + 13lh + (V+s)h, for a model with attention biases, learned position embeddings
    and an output head tied to the token embedding. The spec has no attention biases (4h per
    layer fewer), no position embedding (sh fewer), an untied head (Vh more) and a final
    layernorm (2h more); with those differences the count is exact."""
    _, p = gpt3
    L, h, s, V = 96, 12288, 2048, 51200
    megatron = 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    ours = megatron - 4 * L * h - s * h + V * h + 2 * h
    assert p.parameters == round(ours)
    assert abs(p.parameters / megatron - 1) < 0.01  # and about 175 billion either way


def test_gpt3_as_the_formula_counts_it_is_a_few_words_away() -> None:
    """The terms the spec leaves out are the language's to add (docs/plan.md): attention
    biases (`bias=true`, split like their projections), a learned position embedding and the
    head tied to the embedding give exactly the formula's count, plus the final layernorm."""
    attention = "attention(d, heads, causal=true) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    biased = (
        "attention(d, heads, causal=true, bias=true) shard q[_, model], q_bias[model], k[_, model], "
        "k_bias[model], v[_, model], v_bias[model], o[model, _]"
    )
    embed = "embed: embed(vocab, d) shard table[model, _]"
    head = "head: linear(d, vocab, bias=false) shard kernel[_, model]"
    text = GPT3.read_text()
    for old, new in (
        (attention, biased),
        (embed, f"{embed}\n  pos: position_embed(seq, d)"),
        (head, "head: linear(d, vocab, bias=false) tie kernel = embed.table.T"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    analysis = dslc.analyze(text)
    assert analysis.ok and analysis.program is not None, [d.message for d in analysis.diagnostics]
    L, h, s, V = 96, 12288, 2048, 51200
    megatron = 12 * L * h**2 + 13 * L * h + (V + s) * h  # 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))
    assert plan(analysis.program).parameters == megatron + 2 * h


def test_gpt3_flops_match_megatron_formula(gpt3: tuple[Any, Plan]) -> None:
    """F = 96 B s l h^2 (1 + s/(6h) + V/(16lh)) per iteration with full recomputation (same
    paper, section 5.1). The layer rules also count norms, GELU and the loss, which the
    formula leaves out: within 1%."""
    _, p = gpt3
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    formula = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert abs(p.flops.model / formula - 1) < 0.01


def test_gpt3_bubble_matches_closed_form(gpt3: tuple[Any, Plan]) -> None:
    """(p-1)/m of the ideal time (Narayanan et al. 2021, section 2.2.1); the planner's bubble
    is a fraction of the whole makespan, so bubble / (1 - bubble) is the paper's figure."""
    _, p = gpt3
    assert p.pipeline is not None
    b = p.pipeline.bubble_fraction
    assert b / (1 - b) == pytest.approx((16 - 1) / 192, rel=1e-12)


def test_gpt3_interleaved_bubble_matches_closed_form(tmp_path: Path) -> None:
    """(p-1)/(vm) of the ideal time with v chunks per stage (same paper, section 2.2.2)."""
    spec = tmp_path / "gpt3_interleaved.par"
    spec.write_text(GPT3.read_text().replace("schedule 1f1b", "schedule interleaved-1f1b\n  virtual 2"))
    analysis = dslc.analyze(spec)
    assert analysis.ok and analysis.program is not None
    pipeline = plan(analysis.program).pipeline
    assert pipeline is not None and pipeline.virtual == 2
    b = pipeline.bubble_fraction
    assert b / (1 - b) == pytest.approx((16 - 1) / (2 * 192), rel=1e-12)


_PROBE = """
import json, sys
from dslc.cli import main
code = main(["plan", sys.argv[1], "--format", "json"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "flax", "optax", "numpy"})
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def test_plan_imports_no_accelerator_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(GPT3)], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True
    )
    assert json.loads(done.stderr.strip().splitlines()[-1]) == {"code": 0, "heavy": []}
    assert json.loads(done.stdout)["parameters"] == 175_215_108_096


# ---- the command --------------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, _ = run(capsys, "plan", *argv, "--format", "json")
    assert code == 0
    return json.loads(out)  # type: ignore[no-any-return]


def test_plan_text_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", str(SPECS / "gpt_small.par"))
    assert code == 0 and err == ""
    assert "memory per device" in out and "bubble 20.0%" in out and "warning" not in out


def test_plan_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, str(SPECS / "gpt_small.par"))
    assert set(result) >= {"model", "mesh", "devices", "parameters", "memory", "communication", "flops", "pipeline"}
    assert set(result["memory"]) >= {
        "params",
        "grads",
        "grad_accumulator",
        "optimizer",
        "inputs",
        "activations",
        "temporaries",
        "update",
        "grads_step",
        "total",
        "details",
    }
    assert set(result["communication"]) == {"transfers", "by_kind", "by_axis", "total"}
    assert set(result["communication"]["transfers"][0]) == {"kind", "axes", "phase", "bytes", "count", "hideable"}
    assert set(result["flops"]) >= {"forward", "backward", "recompute", "model", "total", "per_device"}
    assert set(result["pipeline"]) >= {"schedule", "stages", "microbatches", "bubble_fraction"}
    assert result["device_memory"] is None and result["fits"] is None and result["warnings"] == []


def test_plan_spec_errors_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", str(SPECS / "gpt_small.par"), "--mesh", "2x3x2")
    assert code == 1 and "E014" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan"],
        ["plan", "no/such/spec.par"],
        ["plan", str(SPECS / "tiny.par"), "--mesh", "2by2"],
        ["plan", str(SPECS / "tiny.par"), "--device-memory", "-1"],
        ["plan", str(SPECS / "tiny.par"), "--format", "yaml"],
        ["plan", str(SPECS / "tiny.par"), "--set", "nope=1"],
        ["plan", str(SPECS / "tiny.par"), "--xla", "--mesh", "auto", "--devices", "4", "--device-memory", "1"],
    ],
)
def test_plan_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, *argv)[0] == 2


def test_device_memory_too_small_warns(capsys: pytest.CaptureFixture[str]) -> None:
    # GPT-3 175B on its 8x8x16 mesh needs about 32 GiB a device (each stage holds its own six
    # layers): 24 GiB is too little.
    code, out, _ = run(capsys, "plan", str(GPT3), "--device-memory", "24")
    assert code == 0 and "warning: each device needs" in out and "24.00 GiB" in out
    result = plan_json(capsys, str(GPT3), "--device-memory", "24")
    assert result["fits"] is False and result["device_memory"] == 24 << 30 and result["warnings"]
    assert plan_json(capsys, str(GPT3), "--device-memory", "80")["fits"] is True
    assert plan_json(capsys, str(SPECS / "tiny.par"), "--device-memory", "1")["fits"] is True


def test_1f1b_keeps_fewer_activations_than_gpipe(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(SPECS / "seed_mlp_pipeline.par")
    gpipe = plan_json(capsys, spec, "--schedule", "gpipe")
    one_f_one_b = plan_json(capsys, spec, "--schedule", "1f1b")
    assert one_f_one_b["memory"]["activations"] < gpipe["memory"]["activations"]
    assert one_f_one_b["pipeline"]["peak_in_flight"] < gpipe["pipeline"]["peak_in_flight"]


def test_zero_splits_optimizer_state_over_the_data_axis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (SPECS / "tiny.par").read_text()
    figures = {}
    for zero in (0, 1, 2, 3):
        spec = tmp_path / f"zero{zero}.par"
        spec.write_text(text.replace("train {", f"train {{\n  zero {zero}"))
        figures[zero] = plan_json(capsys, str(spec), "--mesh", "4x2")["memory"]
    data = 4
    assert figures[1]["optimizer"] * data == figures[0]["optimizer"]
    assert figures[1]["grads"] == figures[0]["grads"] and figures[2]["grads"] * data == figures[0]["grads"]
    assert figures[3]["params"] * data == figures[0]["params"]
    assert figures[0]["total"] > figures[1]["total"] > figures[2]["total"]
    # ZeRO 3 stores a quarter of the parameters, but tiny's blocks are not checkpointed: its
    # backward keeps every layer's gathered weights, as XLA's step does (seen: 1,673,868 B
    # under zero 3, 1,676,804 under zero 2), so it saves no memory over zero 2 here.
    assert figures[3]["activations"] > figures[2]["activations"]


def test_layer_collectives_are_counted_once_per_microbatch() -> None:
    """gpt_small's tensor-parallel all-reduces run on every microbatch: half the microbatches,
    half the calls, and the same bytes (each call carries its microbatch's share). The
    pipeline's sends follow the schedule's ticks, and the gradient reductions stay once."""

    def transfers(microbatches: int) -> dict[tuple[str, tuple[str, ...], str], tuple[int, int]]:
        text = (SPECS / "gpt_small.par").read_text().replace("microbatches 4", f"microbatches {microbatches}")
        analysis = dslc.analyze(text)
        assert analysis.program is not None
        return {(t.kind, t.axes, t.phase): (t.bytes, t.count) for t in plan(analysis.program).communication}

    four, two = transfers(4), transfers(2)
    layer_phases = ("forward", "backward", "recompute")
    layered = [k for k in four if k[2] in layer_phases]
    assert layered and {k for k in two if k[2] in layer_phases} == set(layered)
    for key in layered:
        assert four[key][1] == 2 * two[key][1], key
        assert four[key][0] == two[key][0], key
    for key in [k for k in four if k[2] == "gradients"]:
        assert four[key] == two[key], key


@pytest.mark.parametrize(("mesh", "neighbours"), [("2x4x2", 1), ("1x2x4", 2)])
def test_pipeline_sends_one_buffer_a_tick_to_each_neighbour(mesh: str, neighbours: int) -> None:
    """The executor sends one boundary buffer a tick to both neighbours round the ring: one
    permutation on two stages (the previous stage is the next), two on more."""
    analysis = dslc.analyze(SPECS / "gpt_small.par", mesh=mesh)
    assert analysis.program is not None
    figures = pipeline_figures(analysis.program)
    assert figures is not None
    sends = [t for t in plan(analysis.program).communication if t.kind == "ppermute"]
    assert [(t.axes, t.phase, t.count) for t in sends] == [(("stage",), "pipeline", neighbours * figures.ticks)]


def test_plan_xla_compiles_the_steps_and_shows_both_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """`--xla` puts XLA's memory analysis of the compiled steps next to the plan (the same
    figures the accuracy tests above compare), in the text and in the JSON."""
    code, out, _ = run(capsys, "plan", str(SPECS / "tiny.par"), "--xla")
    assert code == 0
    assert "compiled by XLA on this machine (memory analysis, per device)" in out
    ratios = [float(r) for r in re.findall(r"planned / XLA (\d\.\d{3})", out)]
    assert len(ratios) == 2 and all(abs(r - 1) <= TOLERANCE for r in ratios), out
    xla = plan_json(capsys, str(SPECS / "tiny.par"), "--xla")
    assert [f"{xla['xla'][k]:.3f}" for k in ("grads_step_ratio", "train_step_ratio")] == [f"{r:.3f}" for r in ratios]
    assert xla["xla"]["grads_step_ratio"] == xla["memory"]["grads_step"] / xla["xla"]["grads_step"]
    assert xla["xla"]["train_step_ratio"] == xla["memory"]["total"] / xla["xla"]["train_step"]
    assert plan_json(capsys, str(SPECS / "tiny.par"))["xla"] is None


# ---- pipelines too large to tabulate ----------------------------------------------------------

HUGE = (TEST_SPECS / "huge.par").read_text()


@pytest.mark.parametrize("kind", ["1f1b", "zb-v"])
def test_a_pipeline_too_large_to_tabulate_is_planned_in_closed_form(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 stages x 2^20 microbatches (the most the language takes) would be a table of 134
    million actions or more: the checker and the planner never build it."""

    def refuse(*args: object) -> None:
        raise AssertionError(f"built a table: {args}")

    monkeypatch.setattr("dslc.schedules.figures.build", refuse)
    monkeypatch.setattr("dslc.ir.schedule.build", refuse)
    analysis = dslc.analyze(HUGE.replace("schedule 1f1b", f"schedule {kind}"), running=False)
    assert analysis.ok and analysis.program is not None
    pipeline = plan(analysis.program).pipeline
    assert pipeline is not None
    P, M = 64, 1 << 20
    work = M if kind == "1f1b" else 6 * M  # a stage's ops, 1f1b's counted in pairs (F, B)
    assert pipeline.bubble_fraction == pipeline.theoretical_bubble == (P - 1) / (work + P - 1)
    assert pipeline.peak_in_flight == (P if kind == "1f1b" else 2 * P)
    # Running it would need the table: `dslc check` says so.
    [refused] = dslc.analyze(HUGE.replace("schedule 1f1b", f"schedule {kind}")).diagnostics
    assert refused.code == "E031" and "more than the 262,144 dslc builds" in refused.message


def test_step_time_hides_what_an_overlapping_program_runs_under_compute() -> None:
    """ZeRO-3's parameter gathers and the gradient reductions XLA issues layer by layer run
    under the compute where the program overlaps collectives (GPU and TPU, with dslc train's
    flags); a pipeline's hand-made once-per-step sums, its sends and tensor-parallel
    collectives stay exposed; without overlap every transfer is exposed."""
    from dslc.plan.step_time import Hardware

    def times(source: str | Path, **hardware: Any) -> Any:
        analysis = dslc.analyze(source)
        assert analysis.ok and analysis.program is not None
        p = plan(analysis.program, hardware=Hardware(**hardware))
        assert p.step_time is not None
        return p

    tiny = (SPECS / "tiny.par").read_text()
    zero3 = times(tiny.replace("train {", "train {\n  zero 3"))
    assert any(t.hideable and t.kind == "all-gather" for t in zero3.communication)
    # On a machine slow enough to compute that the compute covers every hideable transfer.
    slow = times(tiny.replace("train {", "train {\n  zero 3"), device_flops=1e9)
    exposed = times(tiny.replace("train {", "train {\n  zero 3"), device_flops=1e9, overlap=False)
    assert slow.step_time.hidden > 0 and exposed.step_time.hidden == 0
    assert slow.step_time.communication + slow.step_time.hidden == pytest.approx(exposed.step_time.communication)
    assert slow.step_time.total < exposed.step_time.total
    # Never more hidden than there is compute to hide under.
    assert zero3.step_time.hidden <= zero3.step_time.compute
    # gpt_small: 1F1B, its data-parallel sums made by hand once after the last microbatch.
    pipelined = times(SPECS / "gpt_small.par", device_flops=1e9)
    assert not any(t.hideable for t in pipelined.communication if t.phase != "gradients")
    assert pipelined.step_time.hidden == 0
