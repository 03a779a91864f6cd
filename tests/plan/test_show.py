"""`dslc show`: every weight and activation with its sharding, per-device shape and bytes, and
the collectives each layer implies, for every spec in specs/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dslc import cli
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.ir.placement import place
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
    arrays = {a.name: a for a in place(program).arrays}
    # Every stored array is listed, and its bytes count once.
    counted = [w["stored"] for layer in shown["layers"] for w in layer["weights"] if w["bytes"]]
    assert sorted(counted) == sorted(arrays)
    total = sum(w["bytes"] for layer in shown["layers"] for w in layer["weights"])
    assert total == shown["weight_bytes"] == plan(program).memory.params
    # Each weight's per-device shape is its array's global shape split as its partition spec says.
    for layer in shown["layers"]:
        for w in layer["weights"]:
            stored = arrays[w["stored"]].state(program).params
            assert w["partition_spec"] == partition_spec(stored)
            pieces = [program.mesh.size(axes) for axes in stored]
            assert w["local_shape"] == [-(-n // k) for n, k in zip(w["shape"], pieces, strict=True)]
    # The collectives are the layers' own, in order, chunk by chunk.
    implied = [
        (c.kind, list(c.axes))
        for chunk in program.chunks
        for layer in ir.layers(chunk.nodes)
        for c in layer.collectives
    ]
    found = [
        (c["kind"], c["axes"]) for layer in shown["layers"] if layer["kind"] != "layout" for c in layer["collectives"]
    ]
    assert found == implied


def test_text_shows_specs_shapes_bytes_and_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["show", str(SPECS / "gpt_small.par")]) == 0
    out = capsys.readouterr().out
    # Each stage holds its own half of the layers: 107.25 KiB of the 214.50 KiB of weights.
    assert out.startswith("model gpt_small on mesh 2x4x2 (data, model, stage): 107.25 KiB of weights on each device")
    assert "chunk 1 (stage 1)" in out and "  blocks.up (linear, x2)" in out
    # Column-parallel: the kernels split over `model` along their outputs, a quarter of the
    # stage's two layers on each device, stacked in one array.
    assert (
        "    weight  kernel  P('stage', None, 'model')    f32[4, 64, 256]   [2, 64, 64]  32.00 KiB" in out
        and "in `blocks.*.up.kernel`" in out
    )
    assert "all-reduce over model of 128.00 KiB (f32): `blocks.down`: sum of row-parallel partial products" in out


def test_zero_3_stores_weights_split_over_the_data_axis_and_says_how_they_compute(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "z3.par"
    spec.write_text((SPECS / "tiny.par").read_text().replace("train {", "train {\n  zero 3"))
    shown = tensors(checked(spec))
    up = next(row for row in shown.rows if row.path == "layers.up")
    kernel = next(w for w in up.weights if w.name == "kernel")
    # The two layers' kernels, stacked, split over `data` within each layer.
    assert partition_spec(kernel.type.sharding) == "P(None, 'data', 'model')"
    assert partition_spec(kernel.computed) == "P(None, None, 'model')"
    assert "(gathered to P(None, None, 'model') to compute)" in shown.to_text()
    assert shown.weight_bytes == plan(checked(spec)).memory.params


def test_text_columns_line_up_however_wide_their_cells(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Each column is as wide as its widest cell: experts split over `expert` and, under ZeRO-3,
    over `data` too, and activations split over (data, expert), have partition specs wider
    than any fixed column, and every row's cells still start where the header's titles do."""
    spec = tmp_path / "moe_zero3.par"
    spec.write_text((SPECS / "moe_small.par").read_text().replace("train {", "train {\n  zero 3"))
    assert cli.main(["show", str(spec)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "partition spec" in line)
    titles = ("partition spec", "global", "per device")
    starts = [header.index(title) for title in titles]
    right = header.index("bytes") + len("bytes")  # the bytes column is right-aligned
    rows = [line for line in lines if line.startswith(("    weight ", "    output "))]
    specs = [row[starts[0] :].split(") ")[0] + ")" for row in rows]
    assert max(map(len, specs)) > 26, specs  # wider than the fixed column was
    for row in rows:
        spec_cell, global_cell, local_cell = (row[a:b] for a, b in zip(starts, [*starts[1:], right], strict=True))
        assert row[starts[0] - 1] == " " and spec_cell.startswith("P(") and spec_cell.rstrip().endswith(")"), row
        assert re.fullmatch(r"[a-z0-9]+\[[0-9, ]*\] *", global_cell), row
        assert re.fullmatch(r"\[[0-9, ]*\] +[0-9.]+ (B|KiB|MiB|GiB)|\[[0-9, ]*\] +above", local_cell), row
        assert row[right:] == "" or row[right] == " ", row


def test_show_reports_spec_errors_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["show", str(SPECS / "tiny.par"), "--mesh", "3x1"]) == 1
    assert "error[" in capsys.readouterr().err


def test_packed_documents_are_said_by_show_and_counted_by_plan() -> None:
    """A spec whose attention reads document ids and whose loss reads their mask: `show` says
    so, and `plan` counts the two inputs (on tiny's 2x2 mesh each device holds 4 of the 8
    sequences of 32 tokens: 4 x 32 i32 ids and 4 x 32 i8 mask values, 640 bytes)."""
    from tests.train.test_data import PACKED

    program = analyze(PACKED).program
    assert program is not None
    shown = tensors(program)
    said = (
        "documents packed into sequences: `layers.attn` read document ids from `docs` (a query sees only its own "
        "document's keys, rotary positions restart at each); the loss counts only positions where `counted` is "
        "not 0 (not a next document's first)"
    )
    assert said in shown.to_text().splitlines()
    assert shown.to_json()["packing"] == {"segments": "docs", "readers": ["layers.attn"], "mask": "counted"}
    planned = plan(program)
    assert planned.packing_bytes == 4 * 32 * 4 + 4 * 32 * 1
    assert said in planned.to_text() and "their inputs: 640 B per device" in planned.to_text()
    unpacked = analyze(SPECS / "tiny.par").program
    assert unpacked is not None
    assert "documents packed" not in tensors(unpacked).to_text() + plan(unpacked).to_text()
