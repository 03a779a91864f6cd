"""The code generator: golden modules, equivalence with the direct backend, golden numerics.

`pytest --update-goldens` rewrites `generated/*.py` and `tests/golden/numerics/*.json` from
the current output; review the diff before committing it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import dslc
from dslc.codegen import generate_module
from tests.conftest import ROOT, SPECS

GENERATED = ROOT / "generated"
NUMERICS = ROOT / "tests" / "golden" / "numerics"

# Both backends run the same kernels and the same executor in the same order, so on one
# machine they agree to the last bit (measured: max relative difference 0.0 for every spec
# and schedule below); the bound of 1e-6 relative is what is asserted.
EQUIVALENCE = 1e-6

# Specs that run in the test suite, with the constants that keep them small (seed_hybrid_3d:
# 302M parameters at its declared size; the mesh and every strategy stay as written).
RUNNABLE: dict[str, dict[str, int]] = {
    "tiny": {},
    "long_context": {},
    "moe_small": {},
    "gpt_small": {},
    "llama_small": {},
    "seed_mlp_pipeline": {},
    "seed_tp_layer": {},
    "seed_hybrid_3d": {"layers": 4, "seq": 64, "hidden": 128},
    # GPT-2 small at its declared size is 163M parameters; this keeps every layer kind, the
    # mesh and the pipeline.
    "gpt2": {"vocab": 96, "positions": 32, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8},
}
# gpt3_175b is planned, never run: 175B parameters do not fit a test machine. Its module is
# still generated and kept as a golden file, and checked by ruff and by Python's compiler.
PLAN_ONLY = {"gpt3_175b"}
# Run elsewhere, not compared here. llama computes in bf16 inside pipeline stages: the direct
# backend's `forward` scans the blocks of every stage as one loop, the generated module's runs
# stage by stage, and bf16 rounds the two apart (measured, shrunk as in tests/test_interop.py:
# forward 7.6e-3, unpipelined loss 1.9e-5, the pipelined gradients identical; in f32 the
# forward differs by 4e-7). Its numerics are held to an independent reference there.
RUN_ELSEWHERE = {"llama"}


def spec_names() -> list[str]:
    return sorted(p.stem for p in SPECS.glob("*.par"))


def load(text: str, where: Path, name: str) -> ModuleType:
    path = where / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"generated_{name}_{abs(hash(text))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


# ---- golden modules --------------------------------------------------------------------------


def test_every_spec_has_a_golden_module() -> None:
    assert sorted(p.stem for p in GENERATED.glob("*.py")) == spec_names()


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


def test_generated_module_imports_only_jax_flax_optax_numpy_and_the_standard_library() -> None:
    allowed = {"jax", "flax", "optax", "numpy", "__future__"} | set(sys.stdlib_module_names)
    for path in GENERATED.glob("*.py"):
        modules = re.findall(r"^(?:from|import) (\w+)", path.read_text(), flags=re.MULTILINE)
        assert set(modules) <= allowed, (path.name, set(modules) - allowed)


def test_kernel_modules_import_only_what_generated_modules_can() -> None:
    from dslc.codegen.source import PRELUDE_IMPORTS, imported_names
    from dslc.kernels import SOURCES

    for name, path in SOURCES.items():
        assert imported_names(path) <= set(PRELUDE_IMPORTS), name
        assert "dslc" not in path.read_text().split('"""', 2)[-1], f"kernels/{name}.py must not import dslc"


# ---- the same numbers as the direct backend ----------------------------------------------------


def compare_backends(source: str | Path, tmp_path: Path, overrides: dict[str, int] | None = None) -> dict[str, Any]:
    """Same weights in: forward, loss and gradients of both backends; returns the direct ones."""
    program = dslc.compile(source, overrides=overrides)
    module = load(generate_module(source, overrides=overrides), tmp_path, "module")
    model = program.init(0)
    batch = program.example_batch(0)
    weights = program.export_weights(model)
    want_forward = np.asarray(program.forward(model, batch))
    want_loss = float(program.loss(model, batch))
    want_grads = program.grads(model, batch)

    mesh = module.make_mesh()
    with jax.set_mesh(mesh):
        params = {n: jax.device_put(w, NamedSharding(mesh, module.PARAMETERS[n].sharding)) for n, w in weights.items()}
        initial = module.init_params(0, mesh)
        placed = module.place(batch, mesh)
        got_forward = jax.jit(module.forward)(params, placed)
        got_loss = float(jax.jit(module.loss)(params, placed))
        _, got_grads = jax.jit(lambda p, b: module.value_and_grad(p, b, None, mesh))(params, placed)

    # One seed, the same weights: both initialise each weight from a key derived from its name.
    assert all(np.array_equal(np.asarray(initial[n]), weights[n]) for n in weights)
    assert relative_error(got_forward, want_forward) <= EQUIVALENCE
    assert abs(got_loss - want_loss) <= EQUIVALENCE * abs(want_loss)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert relative_error(got_grads[name], g) <= EQUIVALENCE, name
    return {"loss": want_loss, "grads": want_grads, "program": program}


def with_schedule(text: str, kind: str, virtual: int) -> str:
    text = re.sub(r"schedule \S+", f"schedule {kind}", text)
    return re.sub(r"(microbatches \d+)", rf"\1\n  virtual {virtual}", text) if virtual > 1 else text


@pytest.mark.parametrize("name", ["vision", "mixture", "moe_pipelined", "moe_tokens_whole"])
def test_layer_kinds_and_layouts_beyond_the_specs_compute_what_the_direct_backend_computes(
    name: str, tmp_path: Path
) -> None:
    # Convolutions (vision); every other layer kind with GQA, rope and an expert layer whose
    # tokens are whole along the expert axis (mixture); a mixture of experts inside 1F1B
    # pipeline stages, with its auxiliary loss crossing stages (moe_pipelined).
    from tests import test_moe, test_numerics

    text = {
        "vision": test_numerics.VISION,
        "mixture": test_numerics.MIXTURE,
        "moe_pipelined": test_moe.PIPELINED,
        "moe_tokens_whole": test_moe.TOKENS_WHOLE_ALONG_EXPERTS,
    }[name]
    compare_backends(text, tmp_path)


# The spec's own schedule is covered by the golden-numerics test below; these are the others.
# gpt_small: a shorter sequence keeps the compile affordable, the structure is unchanged.
@pytest.mark.parametrize(
    ("spec", "kind", "virtual", "overrides"),
    [
        ("gpt_small", "gpipe", 1, {"seq": 16}),
        ("gpt_small", "interleaved-1f1b", 2, {"seq": 16}),
        ("gpt_small", "zb-h1", 1, {"seq": 16}),
        ("seed_mlp_pipeline", "1f1b", 1, {}),
    ],
)
def test_every_schedule_computes_what_the_direct_backend_computes(
    spec: str, kind: str, virtual: int, overrides: dict[str, int], tmp_path: Path
) -> None:
    text = with_schedule((SPECS / f"{spec}.par").read_text(), kind, virtual)
    assert f"# The {kind} schedule" in generate_module(text, overrides=overrides)
    compare_backends(text, tmp_path, overrides)


# ---- golden numerics ---------------------------------------------------------------------------

# The golden figures were computed on one machine; another CPU or XLA version may round a
# few operations differently. f32: 1e-5 relative is a hundred times the drift between meshes
# seen in test_numerics, yet far below what any change to the model's arithmetic produces.
# bf16 compute (llama_small): one rounding step of bf16 is 4e-3 relative; 1e-2 allows a few.
GOLDEN_RTOL = {"f32": 1e-5, "bf16": 1e-2}


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_both_backends_reproduce_the_golden_numerics(name: str, tmp_path: Path, update_goldens: bool) -> None:
    got = compare_backends(SPECS / f"{name}.par", tmp_path, RUNNABLE[name])
    figures = {
        "spec": f"specs/{name}.par",
        "overrides": RUNNABLE[name],
        "seed": 0,
        "batch_seed": 0,
        "loss": got["loss"],
        "grad_norms": {n: float(np.linalg.norm(np.asarray(g, np.float64))) for n, g in sorted(got["grads"].items())},
    }
    golden = NUMERICS / f"{name}.json"
    if update_goldens:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    want = json.loads(golden.read_text())
    rtol = GOLDEN_RTOL[got["program"].ir.train.compute_dtype]
    assert figures["loss"] == pytest.approx(want["loss"], rel=rtol)
    assert set(figures["grad_norms"]) == set(want["grad_norms"])
    for param, norm in want["grad_norms"].items():
        assert figures["grad_norms"][param] == pytest.approx(norm, rel=rtol, abs=1e-12), param


def test_every_spec_is_run_or_declared_plan_only() -> None:
    assert set(RUNNABLE) | PLAN_ONLY | RUN_ELSEWHERE == set(spec_names())


# ---- running the generated program -------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "seed_mlp_pipeline"])
def test_generated_module_trains_as_a_script(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.py"
    path.write_text((GENERATED / f"{name}.py").read_text())
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}  # it simulates its own mesh
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
    first = run_cli("compile", spec, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = tmp_path / "tiny.py"
    assert written.read_text() == (GENERATED / "tiny.py").read_text()
    assert run_cli("compile", spec, cwd=tmp_path).returncode == 0  # its own output: regenerated

    mine = tmp_path / "mine.py"
    mine.write_text("print('my own code')\n")
    refused = run_cli("compile", spec, "-o", str(mine), cwd=tmp_path)
    assert refused.returncode == 2
    assert "was not written by `dslc compile`" in refused.stderr and "--force" in refused.stderr
    assert mine.read_text() == "print('my own code')\n"
    forced = run_cli("compile", spec, "-o", str(mine), "--force", cwd=tmp_path)
    assert forced.returncode == 0 and mine.read_text() == written.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py", "tiny.py"]  # no temporary files left


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
    assert imported <= {"__future__", "argparse", "functools", "math", "zlib", "typing", "collections", "jax"} | {
        "numpy",
        "optax",
        "flax",
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
    # Inert and still right: the same numbers as the direct backend.
    compare_backends(HOSTILE, tmp_path)


def test_training_steps_match_the_direct_backend(tmp_path: Path) -> None:
    # llama_small: ZeRO-1 optimizer state split over `data`, bf16 compute, adamw with warmup.
    source = SPECS / "llama_small.par"
    program = dslc.compile(source)
    module = load(generate_module(source), tmp_path, "llama")
    model = program.init(0)
    weights = program.export_weights(model)
    state = program.init_optimizer(model)
    want = []
    for i in range(2):
        state, value = program.train_step(model, state, program.example_batch(i), step=i)
        want.append(value)

    mesh = module.make_mesh()
    with jax.set_mesh(mesh):
        params = {n: jax.device_put(w, NamedSharding(mesh, module.PARAMETERS[n].sharding)) for n, w in weights.items()}
        optimizer = module.make_optimizer(*module.OPTIMIZER)
        opt_state = module.init_optimizer(params, optimizer, mesh)
        step = module.make_train_step(mesh, optimizer)
        got = []
        for i in range(2):
            batch = module.place(module.random_batch(i), mesh)
            params, opt_state, value = step(params, opt_state, batch, jax.random.key(i))
            got.append(float(value))
    assert got == pytest.approx(want, rel=EQUIVALENCE)
    for name, value in program.export_weights(model).items():
        assert relative_error(params[name], value) <= EQUIVALENCE, name
