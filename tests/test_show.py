"""`dslc show`: every weight and activation with its sharding, per-device shape and bytes, and
the collectives each layer implies, for every spec in specs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslc import cli
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.ir.state import state_sharding
from dslc.plan import plan
from dslc.plan.tensors import partition_spec, tensors
from tests.conftest import SPECS

SPEC_FILES = sorted(SPECS.glob("*.par"))


def checked(path: Path, **kwargs: object) -> ir.Program:
    analysis = analyze(path, **kwargs)  # type: ignore[arg-type]
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_weight_once_with_bytes_summing_to_the_plans_parameters(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["show", str(path), "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    program = checked(path)
    weights = ir.weights_by_path(program)
    listed = [f"{layer['path']}.{w['name']}" for layer in shown["layers"] for w in layer["weights"]]
    assert listed == list(weights)
    total = sum(w["bytes"] for layer in shown["layers"] for w in layer["weights"])
    assert total == shown["weight_bytes"] == plan(program).memory.params
    # Each weight's per-device shape is its global shape split as its partition spec says.
    for layer in shown["layers"]:
        for w in layer["weights"]:
            stored = state_sharding(weights[f"{layer['path']}.{w['name']}"].type, program).params
            assert w["partition_spec"] == partition_spec(stored)
            pieces = [program.mesh.size(axes) for axes in stored]
            assert w["local_shape"] == [-(-n // k) for n, k in zip(w["shape"], pieces, strict=True)]
    # The collectives are the layers' own, in order.
    implied = [(c.kind, list(c.axes)) for layer in ir.all_layers(program) for c in layer.collectives]
    found = [
        (c["kind"], c["axes"]) for layer in shown["layers"] if layer["kind"] != "layout" for c in layer["collectives"]
    ]
    assert found == implied


def test_text_shows_specs_shapes_bytes_and_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["show", str(SPECS / "gpt_small.par")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model gpt_small on mesh 2x4x2 (data, model, stage): 214.50 KiB of weights on each device")
    assert "chunk 1 (stage 1)" in out
    # Column-parallel: the kernel split over `model` along its outputs, a quarter on each device.
    assert "    weight  kernel       P(None, 'model')           f32[64, 256]           [64, 64]" in out
    assert "all-reduce over model of 128.00 KiB (f32): `blocks.0.down`: sum of row-parallel partial products" in out


def test_zero_3_stores_weights_split_over_the_data_axis_and_says_how_they_compute(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "z3.par"
    spec.write_text((SPECS / "tiny.par").read_text().replace("train {", "train {\n  zero 3"))
    shown = tensors(checked(spec))
    up = next(row for row in shown.rows if row.path == "layers.0.up")
    kernel = next(w for w in up.weights if w.name == "kernel")
    assert partition_spec(kernel.type.sharding) == "P('data', 'model')"
    assert partition_spec(kernel.computed) == "P(None, 'model')"
    assert "(gathered to P(None, 'model') to compute)" in shown.to_text()
    assert shown.weight_bytes == plan(checked(spec)).memory.params


def test_show_reports_spec_errors_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["show", str(SPECS / "tiny.par"), "--mesh", "3x1"]) == 1
    assert "error[" in capsys.readouterr().err
