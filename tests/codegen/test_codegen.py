"""The code generator: golden modules, what runs is what is written, golden numerics.

`pytest --update-goldens` rewrites `generated/*.py` and `tests/golden/numerics/*.json` from
the current output; review the diff before committing it.
"""

from __future__ import annotations

import ast as pyast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dslc
from dslc.codegen import generate_module, source
from dslc.runtime.inputs import place, random_batch
from dslc.runtime.mesh import machine_mesh
from dslc.runtime.params import init_params
from tests import reference
from tests.conftest import ROOT, SPECS, compiled, own_mesh_env

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

GENERATED = ROOT / "generated"
NUMERICS = ROOT / "tests" / "golden" / "numerics"

# Specs that run in the test suite, with the constants that keep them small (seed_hybrid_3d:
# 302M parameters at its declared size; the mesh and every strategy stay as written).
RUNNABLE: dict[str, dict[str, int]] = {
    "tiny": {},
    "long_context": {},
    "moe_small": {},
    "mixtral": {},
    "qwen3_moe": {},
    "qwen2_moe": {},
    "gpt_small": {},
    "llama_small": {},
    "seed_mlp_pipeline": {},
    "seed_tp_layer": {},
    "vit": {},
    "seed_hybrid_3d": {"layers": 4, "seq": 64, "hidden": 128},
    # GPT-2 small at its declared size is 124M parameters; this keeps every layer kind, the
    # mesh and the pipeline, and an odd vocabulary (as GPT-2's 50257) that `model` pads.
    # Pythia-160M's parallel branches, partial rotary and pipeline, small.
    "gpt_neox": {"vocab": 96, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8},
    "gpt2": {"vocab": 95, "positions": 32, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8},
    # Gemma-2-2B's 2.6B parameters, small: two pairs of a local and a global layer, heads
    # of a width of their own (not d / heads), as Gemma's, a window shorter than the sequence.
    "gemma2": {
        "vocab": 96,
        "d": 32,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "ffn": 48,
        "layers": 4,
        "window": 4,
        "seq": 16,
        "batch": 8,
    },
    # Flan-T5's encoder-decoder, small: its streams (the encoder's output, two position
    # biases), cross-attention over sources longer than the targets.
    "t5": {
        "vocab": 96,
        "d": 32,
        "heads": 4,
        "head_dim": 8,
        "ffn": 48,
        "layers": 2,
        "seq": 16,
        "target_seq": 8,
        "batch": 8,
        "buckets": 8,
        "max_distance": 16,
    },
}
# gpt3_175b is planned, never run: 175B parameters do not fit a test machine. Its module is
# still generated and kept as a golden file, and checked by ruff and by Python's compiler.
PLAN_ONLY = {"gpt3_175b"}
# Run elsewhere, not compared here. llama computes in bf16 inside pipeline stages: the direct
# backend's `forward` scans the blocks of every stage as one loop, the generated module's runs
# stage by stage, and bf16 rounds the two apart (measured, shrunk as in tests/interop/test_interop.py:
# forward 7.6e-3, unpipelined loss 1.9e-5, the pipelined gradients identical; in f32 the
# forward differs by 4e-7). Its numerics are held to an independent reference there.
RUN_ELSEWHERE = {"llama"}


def spec_names() -> list[str]:
    return sorted(p.stem for p in SPECS.glob("*.par"))


# ---- golden modules --------------------------------------------------------------------------


def test_every_spec_has_a_golden_module() -> None:
    assert sorted(p.stem for p in GENERATED.glob("*.py")) == spec_names()


def test_generated_holds_the_runtime_library_once(update_goldens: bool) -> None:
    """generated/ is what `dslc compile` writes: the modules and, once, the runtime beside them."""
    from dslc.codegen.source import RUNTIME, runtime_files

    folder = GENERATED / RUNTIME
    if update_goldens:
        folder.mkdir(exist_ok=True)
        for stale in set(p.name for p in folder.glob("*.py")) - set(runtime_files()):
            (folder / stale).unlink()
        for name, text in runtime_files().items():
            (folder / name).write_text(text)
    assert {p.name: p.read_text() for p in folder.glob("*.py")} == runtime_files()


@pytest.mark.parametrize("name", spec_names())
def test_generated_module_matches_its_golden_file(name: str, update_goldens: bool) -> None:
    text = generate_module(SPECS / f"{name}.par")
    assert text == generate_module(SPECS / f"{name}.par"), "output must be byte-identical run to run"
    golden = GENERATED / f"{name}.py"
    if update_goldens:
        golden.write_text(text)
    assert golden.read_text() == text, f"regenerate with `pytest --update-goldens` and review the diff of {golden}"
    compile(text, str(golden), "exec")  # valid Python


def test_golden_modules_are_ruff_clean() -> None:
    files = [str(p) for p in sorted(GENERATED.glob("*.py"))]
    check = subprocess.run([sys.executable, "-m", "ruff", "check", *files], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", *files], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


# What the user reads is what runs, so the largest spec's module must stay readable: the
# model and what depends on the spec, the rest in the runtime library beside it; a repeat
# prints as one loop and one block, a schedule as each stage's timeline, whatever the
# model's depth or the microbatch count (gpt3_175b: 96 layers, 16 stages, 192 microbatches).
def test_the_largest_module_stays_readable() -> None:
    assert len((GENERATED / "gpt3_175b.py").read_text().splitlines()) <= 400


def test_what_runs_the_same_for_every_spec_is_written_once() -> None:
    """No function or class is both in the runtime library and in a template (so in every
    generated module) or in the lowering, which calls the runtime on a module's tables."""
    runtime = set(source.all_definitions())
    templates = {
        name
        for path in (ROOT / "dslc" / "codegen" / "templates").glob("*.j2")
        for name in re.findall(r"^(?:def|class) (\w+)", path.read_text(encoding="utf-8"), re.M)
    }
    lowering = {
        node.name
        for path in (ROOT / "dslc" / "lower").glob("*.py")
        for node in pyast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, pyast.FunctionDef | pyast.ClassDef)
    }
    assert templates and lowering
    assert not runtime & templates, runtime & templates
    assert not runtime & lowering, runtime & lowering


def test_a_deeper_model_is_no_longer_a_module() -> None:
    """A repeat is one loop and one block class: depth changes numbers, not lines."""
    shallow = generate_module(SPECS / "gpt3_175b.par", overrides={"n_layers": 32})
    deep = generate_module(SPECS / "gpt3_175b.par", overrides={"n_layers": 96})
    assert len(deep.splitlines()) == len(shallow.splitlines())


def test_generated_module_imports_only_jax_flax_optax_numpy_the_runtime_and_the_standard_library() -> None:
    allowed = {"jax", "flax", "optax", "numpy", "dslc_runtime", "__future__"} | set(sys.stdlib_module_names)
    for path in GENERATED.glob("*.py"):
        modules = re.findall(r"^(?:from|import) (\w+)", path.read_text(), flags=re.MULTILINE)
        assert set(modules) <= allowed, (path.name, set(modules) - allowed)


def test_runtime_modules_import_only_what_generated_modules_can() -> None:
    from dslc.codegen.source import PRELUDE_IMPORTS, imported_names
    from dslc.runtime import SOURCES

    for name, path in SOURCES.items():
        text = path.read_text()
        # Siblings by relative import, so the runtime runs under either of its names.
        siblings = set(re.findall(r"^from \.(\w+) import", text, flags=re.MULTILINE))
        assert siblings <= set(SOURCES), (name, siblings - set(SOURCES))
        outside = {n for n in imported_names(path) if not re.search(rf"^from \.\w+ import .*\b{n}\b", text, re.M)}
        assert outside <= set(PRELUDE_IMPORTS), (name, outside - set(PRELUDE_IMPORTS))
        assert not re.search(r"^\s*(from|import) dslc\b", text, flags=re.MULTILINE), f"runtime/{name}.py imports dslc"


def test_what_runs_is_what_dslc_compile_writes() -> None:
    # One backend: `dslc.compile` loads the very text `dslc compile` writes.
    program = compiled(SPECS / "tiny.par").program
    assert program.source == (GENERATED / "tiny.py").read_text()


def test_a_traceback_shows_the_generated_line() -> None:
    import traceback

    from dslc.lower.program import load_module

    text = generate_module(SPECS / "seed_tp_layer.par")
    broken = text.replace(
        "        # seed_tp_layer.par:",
        "        raise RuntimeError('broken on purpose')\n        # seed_tp_layer.par:",
        1,
    )
    module = load_module(broken, "seed_tp_layer")
    mesh = machine_mesh(module.MESH_SHAPE, module.MESH_AXES, module.MESH_NODES)
    with jax.set_mesh(mesh), pytest.raises(RuntimeError) as caught:
        params = init_params(module.PARAMETERS, 0, mesh)
        module.forward(params, place(module.INPUTS, random_batch(module.INPUTS, 0), mesh))
    shown = "".join(traceback.format_exception(caught.value))
    assert "raise RuntimeError('broken on purpose')" in shown
    assert "seed_tp_layer.py (generated by dslc" in shown


def test_a_module_whose_mesh_crosses_nodes_builds_it_node_by_node(tmp_path: Path) -> None:
    from dslc.lower.program import load_module

    spec = tmp_path / "tiny.par"
    spec.write_text((SPECS / "tiny.par").read_text().replace("mesh data=2,", "mesh data=2 across 2 nodes,"))
    module = load_module(generate_module(spec, mesh="4x2"), "tiny")
    assert module.MESH_NODES == (2, 1)
    mesh = machine_mesh(module.MESH_SHAPE, module.MESH_AXES, module.MESH_NODES)
    # Simulated in one process, a node is consecutive devices: 0-3 and 4-7, data split
    # between them; without the clause jax may order a mesh's devices as it likes.
    ids = [[d.id for d in row] for row in mesh.devices]
    assert sorted(ids[0] + ids[1]) == list(range(4)) and sorted(ids[2] + ids[3]) == list(range(4, 8))
    assert ids == [[d.id for d in row] for row in dslc.compile(spec, mesh="4x2").mesh.devices]


# ---- golden numerics ---------------------------------------------------------------------------

# The golden figures were computed on one machine; another CPU or XLA version may round a
# few operations differently. f32: 1e-5 relative is a hundred times the drift between meshes
# seen in test_numerics, yet far below what any change to the model's arithmetic produces.
# bf16 compute (llama_small): one rounding step of bf16 is 4e-3 relative; 1e-2 allows a few.
GOLDEN_RTOL = {"f32": 1e-5, "bf16": 1e-2}


@pytest.mark.sample(3)
@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_the_golden_numerics(name: str, update_goldens: bool) -> None:
    got = compiled(SPECS / f"{name}.par", overrides=RUNNABLE[name])
    figures = {
        "spec": f"specs/{name}.par",
        "overrides": RUNNABLE[name],
        "seed": 0,
        "batch_seed": 0,
        "loss": got.loss,
        "grad_norms": {n: float(np.linalg.norm(np.asarray(g, np.float64))) for n, g in sorted(got.grads.items())},
    }
    golden = NUMERICS / f"{name}.json"
    if update_goldens:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    want = json.loads(golden.read_text())
    rtol = GOLDEN_RTOL[got.program.ir.train.compute_dtype]
    assert figures["loss"] == pytest.approx(want["loss"], rel=rtol)
    assert set(figures["grad_norms"]) == set(want["grad_norms"])
    # A gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # constant shift of the scores) is rounding noise, which is relative to the model's
    # gradients as a whole, not to its own size: it gets the same tolerance at their scale.
    noise = rtol * max(want["grad_norms"].values())
    for param, norm in want["grad_norms"].items():
        assert figures["grad_norms"][param] == pytest.approx(norm, rel=rtol, abs=noise), param


def test_every_spec_is_run_or_declared_plan_only() -> None:
    assert set(RUNNABLE) | PLAN_ONLY | RUN_ELSEWHERE == set(spec_names())


# ---- running the generated program -------------------------------------------------------------


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["tiny", "seed_mlp_pipeline"])
def test_generated_module_trains_as_a_script(name: str, tmp_path: Path) -> None:
    """Beside its runtime library, with dslc not importable (a stand-in that refuses)."""
    import shutil

    path = tmp_path / f"{name}.py"
    path.write_text((GENERATED / f"{name}.py").read_text())
    shutil.copytree(GENERATED / "dslc_runtime", tmp_path / "dslc_runtime")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "dslc.py").write_text("raise ImportError('dslc is not installed here')\n")
    env = own_mesh_env() | {"PYTHONPATH": str(tmp_path / "blocked")}  # it simulates its own mesh
    run = subprocess.run(
        [sys.executable, str(path), "--steps", "3"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert run.returncode == 0, run.stderr
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", run.stdout, flags=re.MULTILINE)]
    assert len(losses) == 3 and all(np.isfinite(losses)), run.stdout


# ---- `dslc compile` and what reaches the generated code ---------------------------------------


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dslc.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_compile_writes_a_marked_module_and_refuses_to_overwrite_other_files(tmp_path: Path) -> None:
    spec = str(SPECS / "tiny.par")
    (tmp_path / "tiny.par").write_text((SPECS / "tiny.par").read_text())
    first = run_cli("compile", "tiny.par", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = tmp_path / "tiny.py"
    assert written.read_text() == (GENERATED / "tiny.py").read_text()
    (tmp_path / "tiny.par").unlink()
    assert run_cli("compile", spec, cwd=tmp_path).returncode == 0  # its own output: regenerated

    mine = tmp_path / "mine.py"
    mine.write_text("print('my own code')\n")
    refused = run_cli("compile", spec, "-o", str(mine), cwd=tmp_path)
    assert refused.returncode == 2
    assert "was not written by `dslc compile`" in refused.stderr and "--force" in refused.stderr
    assert mine.read_text() == "print('my own code')\n"
    forced = run_cli("compile", spec, "-o", str(mine), "--force", cwd=tmp_path)
    assert forced.returncode == 0 and "python mine.py --steps 3" in mine.read_text()
    code_of = lambda path: path.read_text().split('"""', 2)[2]  # noqa: E731  the module after its docstring
    assert code_of(mine) == code_of(written)
    # No temporary files left; the runtime library beside the modules, as generated/ holds it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dslc_runtime", "mine.py", "tiny.py"]
    written_runtime = {p.name: p.read_text() for p in (tmp_path / "dslc_runtime").iterdir()}
    assert written_runtime == {p.name: p.read_text() for p in (GENERATED / "dslc_runtime").glob("*.py")}


def test_the_module_says_the_command_that_writes_it_again(tmp_path: Path) -> None:
    # The spec's path, its settings and the output as the user gave them: rerunning the
    # command the docstring shows, from the same folder, writes the same file.
    (tmp_path / "specs").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "specs" / "tiny.par").write_text((SPECS / "tiny.par").read_text())
    argv = ("compile", "specs/tiny.par", "--set", "seq=16", "-o", "out/small tiny.py")
    assert run_cli(*argv, cwd=tmp_path).returncode == 0
    written = (tmp_path / "out" / "small tiny.py").read_text()
    command = "dslc compile specs/tiny.par --mesh 2x2 --set seq=16 -o 'out/small tiny.py' --force"
    assert f"    {command}\n" in written and "python 'small tiny.py' --steps 3" in written
    (tmp_path / "out" / "small tiny.py").unlink()
    assert run_cli(*shlex.split(command)[1:], cwd=tmp_path).returncode == 0
    assert (tmp_path / "out" / "small tiny.py").read_text() == written


def test_compile_reports_bad_input_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.par"
    bad.write_text("model bad\nmesh data=2\ninput x: f32[3 @ data, 4]\nforward(x) { l: linear(5, 4) }\n")
    result = run_cli("compile", str(bad), cwd=tmp_path)
    assert result.returncode == 1 and "error[" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bad.py").exists()
    missing_folder = run_cli("compile", str(SPECS / "tiny.par"), "-o", str(tmp_path / "no" / "x.py"), cwd=tmp_path)
    assert missing_folder.returncode == 2 and "no such folder" in missing_folder.stderr
    folder = run_cli("compile", str(SPECS / "tiny.par"), "-o", str(tmp_path), cwd=tmp_path)
    assert folder.returncode == 2 and "is a folder" in folder.stderr


# Every name a spec can choose, chosen to collide with Python, with the generated module's own
# names and with NNX's; a comment that tries to end the line; a file name that tries to end
# the docstring.
HOSTILE = '''model __import__
mesh data=2, model=2
const d = 8
input _x: f32[4 @ data, d]
input exec: f32[4 @ data, d]
block P(d) {
  class: linear(d, d) shard kernel[_, model], bias[model]  # \u2028import os\r  os.system("echo hi") """
  self: relu()
  __init__: linear(d, d) shard kernel[model, _]
}
block Parameter(d) {
  path: linear(d, d)
  forward: gelu()
}
forward(_x) {
  eval: P(d)
  jax: Parameter(d)
  import: linear(d, d, bias=false)
  loss: mse(exec)
}
'''


def test_hostile_names_and_text_reach_the_module_inert(tmp_path: Path) -> None:
    import ast

    spec = tmp_path / 'evil"""\'; import os #.par'
    spec.write_text(HOSTILE)
    result = run_cli("compile", str(spec), "-o", str(tmp_path / "hostile.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "hostile.py").read_text()
    tree = ast.parse(text)
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "argparse", "functools", "itertools", "math", "zlib", "typing", "collections"} | {
        "jax",
        "numpy",
        "optax",
        "flax",
        "dslc_runtime",
    }
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__", "open", "system"}
    assert "os.system" not in text.replace('os.system(\\"echo hi\\")', "")  # only inside an escaped comment
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(tmp_path / "hostile.py")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout
    # Inert and still right: the numbers of the independent reference.
    run = compiled(HOSTILE)
    want = reference.evaluate(run.program.ir, run.weights, run.batch)
    assert want.loss is not None and run.loss == pytest.approx(want.loss, rel=1e-5)


def test_the_module_names_the_specs_constants() -> None:
    """An argument the spec wrote in its constants reads so in the module, through the blocks
    that pass it on (`gemma2_pair(..., window, attn_cap)`) and in the expression it was written
    as (`repeat layers // 2`); a literal stays a literal; a pipeline stage's share of a
    repeat is its own number, not the constant the whole run was written with."""
    gemma2 = (GENERATED / "gemma2.py").read_text()
    assert "WINDOW = 4096\n" in gemma2 and "window=WINDOW," in gemma2 and "softcap=ATTN_CAP," in gemma2
    assert "scan_layers(self.layers, LAYERS // 2, x, inputs, key)" in gemma2
    t5 = (GENERATED / "t5.py").read_text()
    assert "scale=1.0," in t5 and "heads=HEADS," in t5 and "eps=EPS," in t5
    gpt3 = (GENERATED / "gpt3_175b.py").read_text()
    assert "scan_layers(self.blocks, 6, x, inputs, key)" in gpt3
    # Through a kernel the layer binds for its own (attention's rotary embedding).
    llama = (GENERATED / "llama.py").read_text()
    assert "ROPE_BASE = 10000.0\n" in llama and "rope=functools.partial(rotary, base=ROPE_BASE)," in llama
    assert "dims=ROPE_DIMS)," in (GENERATED / "gpt_neox.py").read_text()
    # A constant the module does not read is not written (llama's `tied`, which only
    # checkpoint import reads).
    assert "const tied" in (SPECS / "llama.par").read_text() and "TIED" not in llama
    # Each layer's output is commented with its shape as the code holds it: GPT-3's 1536
    # sequences a step in 192 microbatches of 8, its MLP's hidden features split over `model`.
    assert 'h = constrain(h, P("data", None, "model"))  # bf16[8@data, 2048, 49152@model]' in gpt3


def test_weight_and_input_shapes_read_in_the_specs_constants() -> None:
    """`PARAMETERS` and `INPUTS` spell each shape by the formula that sized it, in the spec's
    constants: attention's key projection by its grouped heads, a repeat's stacked layers
    by its count, a `heads * (dim // heads)` that is `dim` again as `D`; a dimension the
    constants do not compute (a vocabulary padded to split evenly) stays a number."""
    llama = (GENERATED / "llama.py").read_text()
    assert '("attn.k", (D, KV_HEADS * (D // HEADS)),' in llama and '("attn.q", (D, D),' in llama
    assert "(LAYERS, *shape)," in llama and '"tokens": Input((BATCH, SEQ),' in llama
    assert '("gate_up.gate", (D, FFN), fan_in(D),' in llama and '("down.kernel", (FFN, D), fan_in(FFN),' in llama
    assert "(D, VOCAB)," in llama
    vit = (GENERATED / "vit.py").read_text()
    assert "(SIDE // PATCH * (SIDE // PATCH) + 1, D)," in vit
    gpt2 = (GENERATED / "gpt2.py").read_text()
    # The table's keywords are explained above it, those it uses and no other.
    gpt3 = (GENERATED / "gpt3_175b.py").read_text()
    legend = set(re.findall(r"^# `(\w+)`: ", gpt3, re.M))
    assert legend == {"optimizer_sharding", "layers", "stage_rows", "stage_split"}
    assert all(f"{k}=" in gpt3 for k in legend) and "grad_sharding=" not in gpt3 and "padding=" not in gpt3
    # GPT-2's 50,257 tokens padded by one to split over `model` (the padding keyword says so).
    assert '"wte.table": Parameter((50258, D),' in gpt2 and "padding=(1, 0)" in gpt2 and "# `padding`: " in gpt2


@pytest.mark.parametrize("name", ["llama", "vit", "qwen2_moe", "t5", "gpt2", "seed_mlp_pipeline"])
def test_the_spelled_shapes_are_the_shapes(name: str) -> None:
    """Evaluated, the module's spelled shapes and initializers (`fan_in(D)`) are the
    placement's, array by array."""
    from dslc.ir.placement import place
    from dslc.lower.program import load_module

    program = dslc.analyze(SPECS / f"{name}.par").program
    assert program is not None
    module = load_module(generate_module(SPECS / f"{name}.par"), f"spelled_{name}")
    arrays = place(program).arrays
    assert {a.name: tuple(a.type.shape) for a in arrays} == {n: tuple(p.shape) for n, p in module.PARAMETERS.items()}
    assert {i.name: i.type.shape for i in program.inputs} == {n: i.shape for n, i in module.INPUTS.items()}
    assert {a.name: a.init for a in arrays} == {n: p.init for n, p in module.PARAMETERS.items()}


def test_a_formula_is_spelled_only_where_it_computes_the_number() -> None:
    from dslc.codegen.shapes import Spelled

    dim, heads, kv = Spelled(2048, "D"), Spelled(32, "HEADS"), Spelled(4, "KV")
    assert (heads * (dim // heads)).code == "D"  # exact division: dim again
    assert (kv * (dim // heads)).code == "KV * (D // HEADS)"
    uneven = Spelled(10, "D") // Spelled(3, "H")
    assert (Spelled(3, "H") * uneven).code == "H * (D // H)" and Spelled(3, "H") * uneven == 9
    assert (dim - heads + 1).code == "D - HEADS + 1" and (2 * (dim + 1)).code == "2 * (D + 1)"
    assert dim * 0.5 == 1024.0 and not isinstance(dim * 0.5, Spelled)
