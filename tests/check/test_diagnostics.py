"""What a diagnostic carries that its rendered text does not show, and specs that check clean.

Most of the checker's diagnostics are pinned as fixtures, each a spec beside the text `dslc
check` prints for it (tests/elaborate/diagnostics, tests/elaborate/test_diagnostics_fixtures.py).
The text shows a diagnostic's code, severity, line:column, message, the first line of each
span, its labels, notes and help. Tested here is the rest:

- where a span over several lines ends, and the order of a diagnostic's labels (`SPANS`:
  the text shows only a span's first line, and its labels in source order);
- files that cannot be fixtures: unreadable, not UTF-8, too large, or schedule tables made
  from `dslc schedule`'s own output;
- specs that check clean (a golden cannot show that nothing is printed), among them the
  clean twins of some fixtures: the fixture's spec with the one change that makes it clean;
- what checking leaves behind (a program, its settings), JSON, and what a monkeypatched limit
  or a plan that is not run gives.

Specs written here are built by `spec()`, a minimal valid plan with one part swapped out; its
layout is fixed so spans can be read off it:

    1  model m
    2  mesh data=2, model=2
    3  input x: f32[8 @ data, 16]
    4  input y: f32[8 @ data, 16]
    5  forward(x) {
    6    <body line 1>          (body lines start at column 3)
    7    <body line 2> ...
       }
       <after>

The end of the file holds the catalogue test (docs/diagnostics.md), and the check that every
code the checker can emit is both documented and asserted, here or in a fixture's golden.
"""

from __future__ import annotations

import ast as pyast
import json
import re
from pathlib import Path
from typing import Any

import pytest

import dslc
from dslc.diagnostics import Diagnostic, Severity, render_json, render_text
from dslc.elaborate import body as instantiation
from tests.conftest import ROOT
from tests.elaborate.test_diagnostics_fixtures import FIXTURES, checked, codes_in_goldens

SPECS = sorted((ROOT / "specs").glob("*.par"))
CATALOGUE = ROOT / "docs" / "diagnostics.md"
CODE = re.compile(r"\b[EW]0\d\d\b")

ERROR = Severity.ERROR

HEADER = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 16]\ninput y: f32[8 @ data, 16]\n"
PIPELINE_HEADER = "model m\nmesh data=1, stage=2\ninput x: f32[8 @ data, 16]\ninput y: f32[8 @ data, 16]\n"


def spec(*body: str, header: str = HEADER, after: str = "") -> str:
    """A plan whose forward body is `body` (default: one linear and the loss), see above."""
    lines = body or ("fc: linear(16, 16)", "loss: mse(y)")
    return header + "forward(x) {\n" + "".join(f"  {line}\n" for line in lines) + "}\n" + after


def fixture(case: str) -> str:
    """The text of the fixture `family/case`: its `# check:` options are not applied, a test
    gives its own."""
    return (FIXTURES / f"{case}.par").read_text(encoding="utf-8")


def edited(text: str, old: str, new: str) -> str:
    """`text` with `old`, which must be in it, replaced by `new` (a fixture's clean twin)."""
    assert old in text, f"{old!r} is no longer in the fixture"
    return text.replace(old, new)


def diagnose(text: str | Path, mesh: str | None = None) -> list[Diagnostic]:
    """`text` is a spec's text, or a path to one."""
    return dslc.check(text, mesh=mesh)


def only(text: str | Path, mesh: str | None = None) -> Diagnostic:
    """The single diagnostic for `text`; fails, showing them all, when there are more or none."""
    diags = diagnose(text, mesh)
    assert len(diags) == 1, (render_text(diags, {"<string>": text}) if isinstance(text, str) else diags) or (
        "no diagnostics"
    )
    return diags[0]


def at(d: Diagnostic) -> tuple[int, int, int, int]:
    return (d.span.line, d.span.column, d.span.end_line, d.span.end_column)


def labels(d: Diagnostic) -> list[tuple[tuple[int, int, int, int], str]]:
    return [((lb.span.line, lb.span.column, lb.span.end_line, lb.span.end_column), lb.message) for lb in d.labels]


def test_the_minimal_spec_is_clean() -> None:
    assert diagnose(spec()) == []


# ---- spans the text shows only in part ------------------------------------------------------

# For each diagnostic of the case, in order: its primary span, then its labels' spans, as
# (line, column, end_line, end_column). The text shows a span over several lines as its first
# line, marked to the end, and its labels sorted by line; where such a span ends, and which
# label comes first (as JSON gives them), is pinned here.
SPANS: dict[str, list[list[tuple[int, int, int, int]]]] = {
    "names/e011_second_forward": [[(10, 1, 12, 2), (6, 1, 9, 2)]],
    "axes_and_splits/e014_said_once_for_a_block_used_twice_counts_each_place_once": [
        [(8, 38, 8, 43), (12, 6, 12, 11), (9, 37, 9, 42)]
    ],
    "shapes/e016_residual_branch_changes_the_shape": [[(7, 3, 9, 4), (8, 5, 8, 23)]],
    "shapes/e016_targets_shaped_unlike_the_logits": [[(8, 9, 8, 15), (7, 3, 7, 21), (5, 1, 5, 27)]],
    "shardings/e017_residual_branch_changes_the_sharding": [[(7, 3, 9, 4), (8, 5, 8, 58)]],
    "pipelines/e019_layers_do_not_split_evenly_into_stages": [[(7, 3, 9, 4), (11, 1, 11, 34)]],
    "pipelines/e020_batch_not_divisible_by_accumulation_microbatches_and_data": [
        [(4, 1, 4, 27), (12, 1, 12, 23), (11, 1, 11, 34)]
    ],
    "pipelines/e022_interleaved_needs_microbatches_a_multiple_of_stages": [[(11, 1, 15, 2)]],
    "pipelines/e022_virtual_stages_only_for_interleaved": [[(11, 1, 15, 2)]],
    "pipelines/e031_a_table_too_large_to_run": [[(11, 1, 14, 2)]],
    "mesh/e023_mesh_given_to_a_spec_without_axes": [[(1, 1, 8, 1)]],
    "settings/e026_pipeline_without_microbatches_and_no_cascade": [[(11, 1, 13, 2)]],
    "structure/e028_no_model_declaration": [[(1, 1, 9, 1)]],
    "structure/e028_empty_spec": [[(1, 1, 2, 1)]],
    "structure/e028_stage_without_a_pipeline": [[(7, 3, 9, 4)]],
    "warnings/w001_pipeline_efficiency_below_80_percent": [[(11, 1, 14, 2)]],
    "warnings/w004_zero_without_a_data_parallel_axis": [[(10, 1, 12, 2)]],
}


@pytest.mark.parametrize("case", SPANS)
def test_spans_over_several_lines_end_and_labels_come_in_order(case: str) -> None:
    diags, _ = checked(FIXTURES / f"{case}.par")
    assert [[at(d), *(span for span, _ in labels(d))] for d in diags] == SPANS[case]


# ---- E002, E003: files that cannot be read --------------------------------------------------


def test_e002_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.par"
    path.write_bytes("model café\n".encode("latin-1"))
    d = only(path)
    assert (d.code, d.severity) == ("E002", ERROR)
    assert at(d) == (1, 10, 1, 11)
    assert d.span.file == str(path)
    assert "not UTF-8" in d.message and "0xe9" in d.message and "offset 9" in d.message


def test_e002_file_that_cannot_be_read(tmp_path: Path) -> None:
    d = only(tmp_path / "missing.par")
    assert (d.code, d.severity) == ("E002", ERROR)
    assert at(d) == (1, 1, 1, 1)
    assert d.message.startswith(f"cannot read `{tmp_path / 'missing.par'}`")


def test_e002_a_spec_path_given_as_text_is_read_as_a_path_with_a_did_you_mean(tmp_path: Path) -> None:
    (tmp_path / "gpt_small.par").write_text(spec())
    d = only(str(tmp_path / "gpt_smal.par"))  # a str, as dslc.check("specs/gpt_smal.par") gets it
    assert d.code == "E002" and d.message.startswith(f"cannot read `{tmp_path / 'gpt_smal.par'}`")
    assert d.help == f"did you mean `{tmp_path / 'gpt_small.par'}`?"
    d = only(str(tmp_path))
    assert d.code == "E002" and "directory" in d.message


def test_e003_file_too_large(tmp_path: Path) -> None:
    path = tmp_path / "huge.par"
    path.write_bytes(b"# " + b"x" * (4 * 1024 * 1024) + b"\n")
    d = only(path)
    assert (d.code, d.severity) == ("E003", ERROR)
    assert at(d) == (1, 1, 1, 1)
    assert "larger than 4 MiB" in d.message


# ---- E014: JSON carries every place a split is written -------------------------------------


def test_e014_said_once_json_carries_every_place_as_a_label() -> None:
    """One wrong size of `model` is one E014, at the first weight split over it; the others
    are labels, so JSON carries every place too, not only the note that names them."""
    (d,), _ = checked(FIXTURES / "axes_and_splits/e014_a_mesh_size_no_weight_divides_is_said_once_with_the_count.par")
    (item,) = json.loads(render_json([d]))
    assert [(lb["line"], lb["column"], lb["message"]) for lb in item["labels"]] == [
        (8, 51, "`up.bias`: 64"),
        (9, 37, "`down.kernel`: 64"),
    ]


# ---- E018-E022, E030, E031: pipelines -------------------------------------------------------


def test_pipeline_and_train_settings_read_constants_that_set_changes() -> None:
    # language.md: settings take integer expressions over the spec's constants, so `--set`
    # changes them; `--set v=1` turns an interleaved plan into one chunk per stage.
    text = spec(
        "stages {",
        "  repeat 4 relu()",
        "}",
        "loss: mse(y)",
        header=PIPELINE_HEADER.replace("8 @ data", "16 @ data") + "const mb = 4\nconst acc = 2\nconst v = 2\n",
        after="pipeline stage {\n  schedule interleaved-1f1b\n  microbatches mb\n  virtual v\n}\n"
        "train {\n  accumulate acc\n  optimizer adamw(warmup=acc * 10)\n}\n",
    )
    program = dslc.analyze(text).program
    assert program is not None and program.pipeline is not None
    assert (program.pipeline.microbatches, program.pipeline.virtual, program.train.accumulate) == (4, 2, 2)
    assert dict(program.train.optimizer.hyper) == {"warmup": 20.0}
    assert len(program.chunks) == 4
    changed = dslc.analyze(text, overrides=["mb=2", "acc=4", "v=1"], schedule="1f1b")
    assert changed.ok, changed.diagnostics
    assert changed.program is not None and changed.program.pipeline is not None
    assert (changed.program.pipeline.microbatches, changed.program.pipeline.virtual) == (2, 1)
    assert changed.program.train.accumulate == 4 and len(changed.program.chunks) == 2


def table_spec(tmp_path: Path, table: dict[str, object] | str, pipeline: str = "", stages: int = 2) -> Path:
    """A pipelined spec in `tmp_path` whose schedule is `table.json` beside it (`table` as JSON
    data, or the file's text); `pipeline` adds settings to its section."""
    (tmp_path / "table.json").write_text(table if isinstance(table, str) else json.dumps(table))
    text = spec(
        "stages {",
        f"  repeat {2 * stages} relu()",
        "}",
        header=PIPELINE_HEADER.replace("stage=2", f"stage={stages}"),
        after=f'pipeline stage {{\n  schedule file "table.json"\n{pipeline}}}\n',
    )
    path = tmp_path / "spec.par"
    path.write_text(text)
    return path


def saved(kind: str, stages: int, microbatches: int) -> dict[str, Any]:
    """What `dslc schedule --format json` prints for this table."""
    from dslc.schedules import build, to_json

    return json.loads(json.dumps(to_json(build(kind, stages, microbatches))))


def test_e030_a_saved_table_given_back_is_clean(tmp_path: Path) -> None:
    assert diagnose(table_spec(tmp_path, saved("zb-h1", 2, 8))) == []


def test_e030_an_action_before_its_input_names_the_stage_tick_and_action(tmp_path: Path) -> None:
    table = saved("1f1b", 2, 8)
    stage_1 = table["actions"][1]
    stage_1[0]["tick"] = 0  # its first forward, at the tick stage 0 makes its input
    d = only(table_spec(tmp_path, table))
    assert (d.code, d.severity, at(d)) == ("E030", ERROR, (11, 3, 11, 29))
    assert d.message == (
        f"the schedule table in `{tmp_path / 'table.json'}` cannot run: stage 1, tick 0: F of chunk 1, "
        "microbatch 0 needs the activation of chunk 0, microbatch 0, produced at tick 0; it must be produced "
        "before tick 0"
    )


def test_e030_a_microbatch_done_twice_or_never(tmp_path: Path) -> None:
    table = saved("1f1b", 2, 4)
    rows = table["actions"]
    last_b = rows[0].pop()  # stage 0's last backward: microbatch 3 never finishes
    rows[0].append({**last_b, "microbatch": 2})  # and microbatch 2 gets two
    d = only(table_spec(tmp_path, table, "  microbatches 4\n"))
    assert d.code == "E030"
    problems = [d.message, *d.notes]
    assert any("chunk 0, microbatch 2 has 2 B, 0 I and 0 W" in p for p in problems)
    assert any("chunk 0, microbatch 3 has 0 B, 0 I and 0 W" in p for p in problems)


def test_e030_a_stage_that_runs_a_chunk_it_does_not_hold(tmp_path: Path) -> None:
    table = saved("zb-v", 2, 2)
    table["placement"] = [0, 1, 0, 1]  # the V's actions, on an interleaved placement
    d = only(table_spec(tmp_path, table))
    assert d.code == "E030"
    assert "stage 1, tick 2: F of chunk 2, microbatch 0 runs on the wrong stage: chunk 2 lives on stage 0" in (
        " ".join([d.message, *d.notes])
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not JSON (line 1, column 2)"),
        ("[]", "must be a JSON object with `stages`, `microbatches` and `actions`"),
        ('{"stages": 2, "microbatches": 8, "actions": [], "bubble": 0}', "has unknown keys 'bubble'"),
        ('{"stages": 2, "actions": [[], []]}', "`microbatches` is missing"),
        ('{"stages": 0, "microbatches": 8, "actions": []}', "`stages` must be a whole number of at least 1, got 0"),
        (
            '{"stages": 2, "microbatches": 8, "actions": [[{"tick": 0, "op": "X", "microbatch": 0, "chunk": 0}]]}',
            "actions[0][0].op must be one of F, B, I, W, got 'X'",
        ),
    ],
)
def test_e030_a_file_that_is_not_a_table(tmp_path: Path, text: str, message: str) -> None:
    d = only(table_spec(tmp_path, text))
    assert d.code == "E030"
    assert message in d.message


def test_e030_a_table_for_another_pipeline(tmp_path: Path) -> None:
    d = only(table_spec(tmp_path, saved("1f1b", 4, 8)))
    assert (d.code, at(d)) == ("E030", (11, 3, 11, 29))
    assert d.message == "the schedule table is for 4 stages, but the pipeline axis `stage` has 2"
    d = only(table_spec(tmp_path, saved("1f1b", 2, 8), "  microbatches 4\n"))
    assert (d.code, at(d)) == ("E030", (12, 3, 12, 17))
    assert d.message == "the schedule table has microbatches 8, but the pipeline sets microbatches 4"
    assert labels(d) == [((11, 3, 11, 29), "the table is read here")]


def staged(schedule: str, microbatches: int, batch: int = 8) -> str:
    """Four layers on two stages (four chunks for a V), under `schedule`."""
    return spec(
        "stages {",
        "  repeat 4 relu()",
        "}",
        header=PIPELINE_HEADER.replace("8 @ data", f"{batch} @ data"),
        after=f"pipeline stage {{\n  schedule {schedule}\n  microbatches {microbatches}\n}}\n",
    )


def test_a_v_checks_clean_and_places_its_chunks_in_a_v() -> None:
    analysis = dslc.analyze(staged("zb-v", 8))
    assert analysis.ok and analysis.program is not None, analysis.diagnostics
    assert [c.stage for c in analysis.program.chunks] == [0, 1, 1, 0]


def test_e031_a_table_too_large_to_run_is_still_planned() -> None:
    text = fixture("pipelines/e031_a_table_too_large_to_run")
    assert [d.code for d in dslc.analyze(text).diagnostics] == ["E031"]
    assert dslc.analyze(text, running=False).ok


def test_e031_v_half_too_large_even_to_plan() -> None:
    text = staged("v-half", 1 << 16, batch=1 << 16)
    planned = dslc.analyze(text, running=False).diagnostics
    assert [d.code for d in planned] == ["E031"]
    assert "has no closed form to plan by" in planned[0].message


# ---- E023: --mesh, where it fits ----------------------------------------------------------


def test_a_mesh_axis_without_a_size_takes_one_from_mesh() -> None:
    assert diagnose(fixture("mesh/e023_mesh_axis_without_a_size"), mesh="2x2") == []


def test_an_axis_across_nodes_that_split_it_is_clean() -> None:
    # The fixture's own sizes (data=4 over 4 nodes), and data=8 over them, split evenly.
    across = fixture("mesh/e023_an_axis_across_nodes_that_do_not_split_it")
    assert diagnose(across) == [] and diagnose(across, mesh="8x1") == []


# ---- E025: arithmetic ------------------------------------------------------------------------


def test_a_fractional_constant_not_used_as_a_dimension_is_clean() -> None:
    # A constant may hold a fraction (a dropout rate, an epsilon); it is refused only where a
    # dimension needs an integer (arithmetic/e025_a_fractional_constant_where_an_integer_is_needed).
    assert diagnose(spec(header=HEADER + "const rate = 0.1\n")) == []


def test_repeats_are_elaborated_once() -> None:
    # A repeat is one node of the IR whatever its count: nested, 4096 x 4096 copies check in
    # no time.
    assert not diagnose(spec("repeat 4096 {", "  repeat 4096 relu()", "}", "loss: mse(y)"))


def test_e025_too_many_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A repeat whose block changes its input's type (here its sharding, on the first copy)
    # cannot loop: its copies are elaborated one by one, and so are bounded. The real limit
    # (200,000) takes seconds to reach; the check is the same at 10.
    monkeypatch.setattr(instantiation, "MAX_NODES", 10)
    d = only(spec("repeat 40 {", "  layout [_, model]", "  relu()", "}", "loss: mse(y)"))
    assert (d.code, d.message) == ("E025", "the model expands to more than 10 layers")
    assert at(d) == (8, 5, 8, 11)  # the layer that crossed the limit


# ---- E027, E032, E033: weights the clauses may name ---------------------------------------------


def test_a_weight_other_arguments_would_give_may_be_sharded() -> None:
    """One spec serves both settings of a bias switched by a constant: the clause applies when
    the weight exists. A name the layer kind never has is still an error
    (weight_sharding/e027_a_weight_the_layer_kind_never_has)."""
    header = HEADER.replace("input y", "const biased = false\ninput y")
    text = spec(
        "fc: linear(16, 16, bias=biased) shard kernel[_, model], bias[model]",
        "down: linear(16, 16, bias=false) shard kernel[model, _]",
        "loss: mse(y)",
        header=header,
    )
    assert diagnose(text) == []
    assert dslc.check(text, overrides={"biased": True}) == []


def test_tied_weights_check_clean() -> None:
    """A square kernel read transposed by a later layer: column parallel there, row parallel
    here, so the two chain like a Megatron MLP."""
    text = spec(
        "a: linear(16, 16, bias=false) shard kernel[_, model]",
        "b: linear(16, 16, bias=false) tie kernel = a.kernel.T",
        "loss: mse(y)",
    )
    assert diagnose(text) == []


def test_a_padded_vocabulary_read_by_the_head_before_the_loss_is_clean() -> None:
    """63 tokens over model=2 are padded to 64: a head right before cross_entropy may read the
    table (the loss masks the extra logit); with a layer between them it may not (the fixture)."""
    text = fixture("ties/e033_a_padded_vocabulary_read_where_its_padding_cannot_be_masked")
    assert diagnose(edited(text, "  gelu()\n", "")) == []


# ---- W001, W004, W005: warnings that depend on the plan -------------------------------------


def test_w001_comes_from_the_fixtures_options_not_its_spec() -> None:
    """The case's `--set mb=2 --schedule gpipe` make the bubble: the spec as written (1F1B over
    8 microbatches) is clean, so the golden shows the options were applied."""
    assert dslc.check(fixture("warnings/w001_with_set_and_schedule")) == []


W005_F32 = "warnings/w005_no_fused_kernel_for_f32_heads_on_gpu"
W005_WIDE = "warnings/w005_no_fused_kernel_for_a_head_width_of_160_on_gpu"


@pytest.mark.parametrize(
    ("case", "backend"), [(W005_F32, None), (W005_WIDE, None), (W005_F32, "tpu"), (W005_F32, "cpu")]
)
def test_w005_is_said_only_for_a_backend_without_a_fused_kernel_for_the_layer(case: str, backend: str | None) -> None:
    assert dslc.check(fixture(case), backend=backend) == []


def test_w005_16_bit_heads_of_a_usual_width_have_a_gpu_kernel() -> None:
    assert dslc.check(fixture(W005_F32) + "train { compute_dtype bf16 }\n", backend="gpu") == []


def test_w004_zero_3_with_checkpoints_gathers_the_weights_again() -> None:
    # Checkpointed, each layer's backward gathers its weights again: no warning.
    text = fixture("warnings/w004_zero_3_without_checkpoints_keeps_the_gathered_weights")
    assert diagnose(edited(text, "block mlp() {", "block mlp() checkpoint full {"), mesh="4x1") == []


# ---- renderings ------------------------------------------------------------------------------


def test_json_rendering_has_every_field() -> None:
    text = spec("fc: linear(16, 16, bais=false)", "loss: mse(y)")
    items = json.loads(render_json(diagnose(text)))
    assert len(items) == 1
    item = items[0]
    for key in ("severity", "code", "message", "file", "line", "column", "end_line", "end_column", "notes"):
        assert key in item, key
    assert item["severity"] == "error" and item["code"] == "E024"
    assert (item["line"], item["column"], item["end_line"], item["end_column"]) == (6, 22, 6, 26)
    assert item["file"] == "<string>"
    assert item["notes"] == ["`linear` arguments: in, out, bias"]
    assert item["help"] == "did you mean `bias`?"


def test_json_rendering_carries_labels() -> None:
    items = json.loads(render_json(diagnose(spec("fc: linear(16, 16)", "fc: relu()", "loss: mse(y)"))))
    assert items[0]["labels"] == [
        {"message": "first used here", "line": 6, "column": 3, "end_line": 6, "end_column": 5}
    ]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_example_spec_checks_without_errors(path: Path) -> None:
    diags = dslc.check(path)
    assert not [d for d in diags if d.is_error], render_text(diags, {str(path): path.read_text()})


# ---- the catalogue: docs/diagnostics.md -----------------------------------------------------------

_SECTION = re.compile(r"^## ([EW]0\d\d)\n", re.M)
_EXAMPLE = re.compile(r"^```par(?P<info>[^\n]*)\n(?P<spec>.*?)^```\n", re.M | re.S)
_OUTPUT = re.compile(r"^```text\n(?P<text>.*?)^```\n", re.M | re.S)


def _sections(doc: str) -> dict[str, tuple[int, int]]:
    """Each code's section of the catalogue, as (start, end) offsets."""
    found = list(_SECTION.finditer(doc))
    ends = [m.start() for m in found[1:]] + [len(doc)]
    return {m.group(1): (m.start(), end) for m, end in zip(found, ends, strict=True)}


def _codes_in_source() -> set[str]:
    """Every code the checker can emit: the code literals in dslc/."""
    return {
        code
        for path in (ROOT / "dslc").rglob("*.py")
        for code in re.findall(r"[\"']([EW]0\d\d)[\"']", path.read_text(encoding="utf-8"))
    }


def _codes_asserted_here() -> set[str]:
    """The codes named in this file's tests, outside the catalogue's own tests."""
    tree = pyast.parse(Path(__file__).read_text(encoding="utf-8"))
    return {
        node.value
        for fn in tree.body
        if isinstance(fn, pyast.FunctionDef) and fn.name.startswith("test_") and "catalogue" not in fn.name
        for node in pyast.walk(fn)
        if isinstance(node, pyast.Constant) and isinstance(node.value, str) and CODE.fullmatch(node.value)
    }


@pytest.mark.parametrize("code", sorted(_sections(CATALOGUE.read_text(encoding="utf-8"))))
def test_catalogue_example_prints_what_the_catalogue_shows(
    code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, update_goldens: bool
) -> None:
    doc = CATALOGUE.read_text(encoding="utf-8")
    start, end = _sections(doc)[code]
    example = _EXAMPLE.search(doc, start, end)
    output = _OUTPUT.search(doc, start, end)
    assert example and output, f"the {code} entry needs a ```par example and a ```text output"
    info = dict(part.split("=", 1) for part in example.group("info").split())
    path = tmp_path / "example.par"
    path.write_bytes(example.group("spec").encode(info.get("encoding", "utf-8")))
    monkeypatch.chdir(tmp_path)
    diags = dslc.check("example.par", mesh=info.get("mesh"), backend=info.get("backend"))
    assert {d.code for d in diags} == {code}, f"the {code} example gives {[d.code for d in diags]}"
    try:
        sources = {"example.par": path.read_text(encoding="utf-8")}
    except UnicodeDecodeError:  # as `dslc check` does: a file it cannot read has no excerpt
        sources = {}
    printed = render_text(diags, sources)
    if update_goldens:
        doc = doc[: output.start("text")] + printed + doc[output.end("text") :]
        CATALOGUE.write_text(doc, encoding="utf-8")
    else:
        assert output.group("text") == printed, f"{code}'s output changed; review, then rerun with --update-goldens"


def test_catalogue_documents_exactly_the_codes_the_checker_can_emit() -> None:
    documented = set(_sections(CATALOGUE.read_text(encoding="utf-8")))
    in_source = _codes_in_source()
    assert in_source, "found no codes in dslc/"
    assert in_source - documented == set(), "codes without an entry in docs/diagnostics.md"
    assert documented - in_source == set(), "docs/diagnostics.md documents codes dslc no longer emits"


def test_catalogue_codes_each_have_a_test() -> None:
    asserted = _codes_asserted_here() | codes_in_goldens()
    assert _codes_in_source() - asserted == set(), "codes no test here and no fixture's golden asserts"
