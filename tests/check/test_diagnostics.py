"""Every diagnostic dslc reports: its code, severity, exact span and the numbers it quotes.

Each test feeds a tiny spec to `dslc.check` and pins the one thing wrong with it. Most specs
are built by `spec()`, a minimal valid plan with one part swapped out; its layout is fixed so
spans can be read off it:

    1  model m
    2  mesh data=2, model=2
    3  input x: f32[8 @ data, 16]
    4  input y: f32[8 @ data, 16]
    5  forward(x) {
    6    <body line 1>          (body lines start at column 3)
    7    <body line 2> ...
       }
       <after>

The end of the file holds the golden rendering test (tests/golden/diagnostics) and the
catalogue test (docs/diagnostics.md), and the check that every code the checker can emit is
both documented and asserted here.
"""

from __future__ import annotations

import ast as pyast
import json
import re
import textwrap
from pathlib import Path

import pytest

import dslc
from dslc.diagnostics import Diagnostic, Severity, render_json, render_text
from dslc.elaborate import body as instantiation
from tests.conftest import ROOT

SPECS = sorted((ROOT / "specs").glob("*.par"))
GOLDEN = ROOT / "tests" / "golden" / "diagnostics"
CATALOGUE = ROOT / "docs" / "diagnostics.md"
CODE = re.compile(r"\b[EW]0\d\d\b")

ERROR, WARNING = Severity.ERROR, Severity.WARNING

HEADER = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 16]\ninput y: f32[8 @ data, 16]\n"


def spec(*body: str, header: str = HEADER, after: str = "") -> str:
    """A plan whose forward body is `body` (default: one linear and the loss), see above."""
    lines = body or ("fc: linear(16, 16)", "loss: mse(y)")
    return header + "forward(x) {\n" + "".join(f"  {line}\n" for line in lines) + "}\n" + after


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def diagnose(text: str | Path, mesh: str | None = None) -> list[Diagnostic]:
    """`text` is a spec's text, or a path to one."""
    return dslc.check(text, mesh=mesh)


def shown(diags: list[Diagnostic], text: str) -> str:
    return render_text(diags, {"<string>": text})


def only(text: str | Path, mesh: str | None = None) -> Diagnostic:
    """The single diagnostic for `text`; fails, showing them all, when there are more or none."""
    diags = diagnose(text, mesh)
    assert len(diags) == 1, (shown(diags, text) if isinstance(text, str) else diags) or "no diagnostics"
    return diags[0]


def written(d: Diagnostic, text: str) -> str:
    """The text of `d`'s primary span (one line)."""
    line = text.split("\n")[d.span.line - 1]
    return line[d.span.column - 1 : d.span.end_column - 1]


def at(d: Diagnostic) -> tuple[int, int, int, int]:
    return (d.span.line, d.span.column, d.span.end_line, d.span.end_column)


def labels(d: Diagnostic) -> list[tuple[tuple[int, int, int, int], str]]:
    return [((lb.span.line, lb.span.column, lb.span.end_line, lb.span.end_column), lb.message) for lb in d.labels]


def codes(text: str, mesh: str | None = None) -> list[str]:
    return [d.code for d in diagnose(text, mesh)]


def test_the_minimal_spec_is_clean() -> None:
    assert diagnose(spec()) == []


# ---- E001-E003: reading and parsing -----------------------------------------------------------


def test_e001_syntax_error_points_at_the_unexpected_token() -> None:
    d = only(spec().replace("f32[8 @ data, 16]\ninput y", "f32[8 @ data, 16\ninput y"))
    assert (d.code, d.severity) == ("E001", ERROR)
    assert at(d) == (4, 1, 4, 6)
    assert d.message == "unexpected `input`"
    assert d.notes == ("expected `,`, `@` or `]`",)


def test_e001_unexpected_character() -> None:
    d = only(spec("fc: linear(16, 16) $", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E001", ERROR)
    assert at(d) == (6, 22, 6, 23)
    assert d.message.startswith("unexpected character") and "$" in d.message


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


def test_e003_brackets_nested_too_deep() -> None:
    text = "model m\nconst a = " + "(" * 70 + "1" + ")" * 70 + "\n"
    d = only(text)
    assert (d.code, d.severity) == ("E003", ERROR)
    assert at(d) == (2, 11 + 64, 2, 12 + 64)  # the 65th bracket
    assert "64" in d.message


def test_e003_file_too_large(tmp_path: Path) -> None:
    path = tmp_path / "huge.par"
    path.write_bytes(b"# " + b"x" * (4 * 1024 * 1024) + b"\n")
    d = only(path)
    assert (d.code, d.severity) == ("E003", ERROR)
    assert at(d) == (1, 1, 1, 1)
    assert "larger than 4 MiB" in d.message


# ---- E010-E015: names, axes and splits -------------------------------------------------------


def test_e010_unknown_layer_suggests_the_closest_name() -> None:
    d = only(spec("fc: lineer(16, 16)", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E010", ERROR)
    assert at(d) == (6, 7, 6, 13)
    assert d.message == "unknown layer or block `lineer`"
    assert d.help == "did you mean `linear`?"


def test_e010_unknown_constant_in_a_dimension() -> None:
    text = "model m\nconst hidden = 16\ninput x: f32[8, hiden]\nforward(x) {\n  relu()\n}\n"
    d = only(text)
    assert (d.code, d.severity) == ("E010", ERROR)
    assert at(d) == (3, 17, 3, 22)
    assert d.message == "unknown constant `hiden`"
    assert d.help == "did you mean `hidden`?"


def test_e010_constant_used_before_its_definition_says_so() -> None:
    text = "model m\nconst a = b\nconst b = 2\ninput x: f32[8, 16]\nforward(x) {\n  relu()\n}\n"
    d = only(text)
    assert (d.code, at(d)) == ("E010", (2, 11, 2, 12))
    assert d.message == "constant `b` is used before it is defined"
    assert labels(d) == [((3, 7, 3, 8), "defined here")]


def test_e010_unknown_input_of_forward_and_of_a_loss() -> None:
    d = only(spec().replace("forward(x)", "forward(z)"))
    assert (d.code, at(d), d.message) == ("E010", (5, 9, 5, 10), "unknown input `z`")
    assert d.notes == ("known: `x`, `y`",)
    d = only(spec("fc: linear(16, 16)", "loss: mse(yy)"))
    assert (d.code, at(d), d.help) == ("E010", (7, 13, 7, 15), "did you mean `y`?")


def test_e010_unknown_dtype() -> None:
    d = only(spec().replace("input y: f32", "input y: f23"))
    assert (d.code, at(d), d.message, d.help) == ("E010", (4, 10, 4, 13), "unknown dtype `f23`", "did you mean `f32`?")


def test_e011_constant_defined_twice_points_at_both() -> None:
    text = "model m\nconst d = 8\nconst d = 16\ninput x: f32[8, d]\nforward(x) {\n  relu()\n}\n"
    d = only(text)
    assert (d.code, d.severity) == ("E011", ERROR)
    assert at(d) == (3, 7, 3, 8)
    assert d.message == "constant `d` is defined twice"
    assert labels(d) == [((2, 7, 2, 8), "first defined here")]


def test_e011_two_layers_with_one_label() -> None:
    d = only(spec("fc: linear(16, 16)", "fc: relu()", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E011", (7, 3, 7, 5), "`fc` names two layers in the same scope")
    assert labels(d) == [((6, 3, 6, 5), "first used here")]


def test_e011_second_forward() -> None:
    d = only(spec(after="forward(x) {\n  relu()\n}\n"))
    assert (d.code, at(d), d.message) == ("E011", (9, 1, 11, 2), "a spec has one `forward` declaration")
    assert labels(d) == [((5, 1, 8, 2), "first declared here")]


def test_e011_block_named_like_a_builtin_layer() -> None:
    d = only(spec(header=HEADER + "block linear(d) {\n  relu()\n}\n"))
    assert (d.code, at(d), d.message) == ("E011", (5, 7, 5, 13), "block `linear` has the name of a built-in layer")


def test_e012_unknown_mesh_axis_in_a_sharding() -> None:
    d = only(spec("fc: linear(16, 16) shard kernel[_, modle]", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E012", ERROR)
    assert at(d) == (6, 38, 6, 43)
    assert d.message == "unknown mesh axis `modle`"
    assert d.help == "did you mean `model`?"


def test_e012_the_pipeline_axis_cannot_split_a_tensor() -> None:
    text = dedent("""
        model m
        mesh data=1, stage=2
        input x: f32[8 @ data, 16]
        forward(x) {
          stages {
            fc: linear(16, 16) shard kernel[_, stage]
            relu()
          }
        }
        pipeline stage { microbatches 8 }
    """)
    d = only(text)
    assert (d.code, at(d)) == ("E012", (6, 40, 6, 45))
    assert d.message == "`stage` is the pipeline axis; it splits the model into stages, not tensors"


def test_e012_unknown_pipeline_axis_and_nothing_else() -> None:
    text = dedent("""
        model m
        mesh data=1, stage=2
        input x: f32[8 @ data, 16]
        forward(x) {
          stages {
            repeat 2 relu()
          }
        }
        pipeline stge { microbatches 8 }
    """)
    d = only(text)  # not also "`stages` marks pipeline chunks, but the spec declares no pipeline"
    assert (d.code, at(d), d.help) == ("E012", (9, 10, 9, 14), "did you mean `stage`?")


def test_e013_one_axis_twice_in_one_tensor() -> None:
    d = only(spec().replace("input x: f32[8 @ data, 16]", "input x: f32[8 @ data, 16 @ data]"))
    assert (d.code, d.severity) == ("E013", ERROR)
    assert at(d) == (3, 29, 3, 33)
    assert d.message == "mesh axis `data` is used twice in the sharding of input `x`"
    assert labels(d) == [((3, 18, 3, 22), "first used here")]


def test_e014_dimension_not_divisible_lists_sizes_that_work() -> None:
    d = only(spec("fc: linear(16, 16, bias=false) shard kernel[_, model]", "loss: mse(y)"), mesh="2x3")
    assert (d.code, d.severity) == ("E014", ERROR)
    assert at(d) == (6, 50, 6, 55)
    assert d.message == (
        "dimension 1 of weight `fc.kernel` has size 16, which does not split evenly over model=3 (3 pieces)"
    )
    assert d.notes == ("mesh 2x3 (data, model)", "16 splits evenly into 1, 2, 4, 8, 16 pieces")


def test_e014_a_mesh_size_no_weight_divides_is_said_once_with_the_count() -> None:
    """One wrong size of `model` is one mistake, not one per weight split over it: a single
    E014 at the first such weight, the others counted and named in a note, each labelled where
    its split is written (so JSON carries every place too)."""
    text = spec(
        "up: linear(16, 64) shard kernel[_, model], bias[model]",
        "down: linear(64, 16) shard kernel[model, _]",
        "loss: mse(y)",
    )
    d = only(text, mesh="2x3")
    assert (d.code, at(d)) == ("E014", (6, 38, 6, 43))
    assert d.message == (
        "dimension 1 of weight `up.kernel` has size 64, which does not split evenly over model=3 (3 pieces)"
    )
    assert labels(d) == [((6, 51, 6, 56), "`up.bias`: 64"), ((7, 37, 7, 42), "`down.kernel`: 64")]
    assert d.notes == (
        "mesh 2x3 (data, model)",
        "64 splits evenly into 1, 2, 4, 8, 16, 32, 64 pieces",
        "and 2 more weights split over model=3 do not divide evenly: `up.bias`, `down.kernel`",
    )
    (item,) = json.loads(render_json([d]))
    assert [(lb["line"], lb["column"], lb["message"]) for lb in item["labels"]] == [
        (6, 51, "`up.bias`: 64"),
        (7, 37, "`down.kernel`: 64"),
    ]


def test_e014_said_once_for_a_block_used_twice_counts_each_place_once() -> None:
    """The block's body is one text: its two uses make the same two mistakes, one report."""
    block = (
        "block mlp() {\n  up: linear(16, 64) shard kernel[_, model]\n  down: linear(64, 16) shard kernel[model, _]\n}\n"
    )
    text = spec("a: mlp()", "b: mlp()", "loss: mse(y)", header=HEADER + block)
    d = only(text, mesh="2x3")
    assert (d.code, d.span.line) == ("E014", 6)
    assert "`a.up.kernel` has size 64" in d.message
    assert labels(d) == [((10, 6, 10, 11), "in this use of `mlp`"), ((7, 37, 7, 42), "`a.down.kernel`: 64")]
    assert d.notes[-1] == "and 1 more weight split over model=3 does not divide evenly: `a.down.kernel`"


def test_e014_weights_that_do_not_divide_are_grouped_by_the_axes_they_split_over() -> None:
    header = "model m\nmesh data=3, model=3\ninput x: f32[9 @ data, 16]\ninput y: f32[9 @ data, 16]\n"
    text = spec(
        "up: linear(16, 64) shard kernel[data, model], bias[model]",
        "down: linear(64, 16) shard kernel[model, data]",
        "loss: mse(y)",
        header=header,
    )
    diags = diagnose(text)
    assert [(d.code, d.span.line) for d in diags] == [("E014", 6), ("E014", 6)], shown(diags, text)
    by_axis, by_model = diags
    assert "`up.kernel` has size 16, which does not split evenly over data=3" in by_axis.message
    assert by_axis.notes[-1] == "and 1 more weight split over data=3 does not divide evenly: `down.kernel`"
    assert "`up.kernel` has size 64, which does not split evenly over model=3" in by_model.message
    assert by_model.notes[-1] == (
        "and 2 more weights split over model=3 do not divide evenly: `up.bias`, `down.kernel`"
    )


def test_e014_batch_over_two_axes_multiplies_their_sizes() -> None:
    d = only(spec().replace("input y: f32[8 @ data, 16]", "input y: f32[8 @ (data, model), 16]"), mesh="2x8")
    assert (d.code, at(d)) == ("E014", (4, 18, 4, 31))
    assert "size 8" in d.message and "data=2 x model=8 (16 pieces)" in d.message


ATTENTION_HEADER = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 4, 48]\ninput y: f32[8 @ data, 4, 48]\n"


def test_e015_heads_not_divisible_by_the_tensor_parallel_size() -> None:
    attn = "attn: attention(48, 6) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    d = only(spec(attn, header=ATTENTION_HEADER), mesh="2x4")
    assert (d.code, d.severity) == ("E015", ERROR)
    assert at(d) == (6, 32, 6, 43)  # q's shard clause: where the heads are split
    assert d.message == "6 attention heads cannot be split over `model` of size 4"
    assert d.notes[0] == "heads = 6 splits evenly over an axis of size 1, 2, 3 or 6"


def test_e015_kv_heads_not_divisible() -> None:
    attn = "attn: attention(48, 4, kv_heads=1) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    d = only(spec(attn, header=ATTENTION_HEADER))
    assert (d.code, at(d)) == ("E015", (6, 57, 6, 68))  # k's shard clause
    assert d.message == "1 key/value heads cannot be split over `model` of size 2"
    assert d.help is not None and "k[_, _], v[_, _]" in d.help


# ---- E016: shapes ---------------------------------------------------------------------------


def test_e016_feature_count_mismatch_points_at_layer_and_producer() -> None:
    d = only(spec("up: linear(16, 32)", "down: linear(16, 16)"))
    assert (d.code, d.severity) == ("E016", ERROR)
    assert at(d) == (7, 9, 7, 23)
    assert d.message == "`down` expects 16 input features, but its input has 32 in f32[8@data, 32]"
    assert labels(d) == [((6, 3, 6, 21), "input produced here: f32[8@data, 32]")]


def test_e016_wrong_rank_for_attention() -> None:
    d = only(spec("attn: attention(16, 2)"))
    assert (d.code, at(d)) == ("E016", (6, 9, 6, 25))
    assert d.message == "`attn` expects [batch, seq, dim], but its input is f32[8@data, 16]"


def test_e016_float_layer_fed_integers() -> None:
    text = "model m\ninput t: i32[8, 16]\nforward(t) {\n  relu()\n}\n"
    d = only(text)
    assert (d.code, at(d)) == ("E016", (4, 3, 4, 9))
    assert d.message == "`relu` needs floating-point input, but its input is i32[8, 16]"
    assert labels(d) == [((2, 1, 2, 20), "input produced here")]


def test_e016_residual_branch_changes_the_shape() -> None:
    d = only(spec("residual {", "  up: linear(16, 32)", "}", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E016", (6, 3, 8, 4))
    assert d.message == (
        "a residual branch must keep its input's shape, but it turns f32[8@data, 16] into f32[8@data, 32]"
    )
    assert labels(d) == [((7, 5, 7, 23), "branch output produced here")]


def test_e016_targets_shaped_unlike_the_logits() -> None:
    d = only(spec().replace("input y: f32[8 @ data, 16]", "input y: f32[8 @ data, 12]"))
    assert (d.code, at(d)) == ("E016", (7, 9, 7, 15))
    assert "the activation is f32[8@data, 16] and the targets are f32[8@data, 12]" in d.message
    assert [m for _, m in labels(d)] == ["activation produced here", "targets declared here"]


def test_e016_layout_with_the_wrong_number_of_dimensions() -> None:
    d = only(spec("fc: linear(16, 16)", "layout [data, _, _]", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E016", (7, 3, 7, 22))
    assert d.message == "`layout` gives 3 dimensions, but the activation here has 2: f32[8@data, 16]"


def test_e016_inputs_with_different_batch_sizes() -> None:
    d = only(spec().replace("input y: f32[8 @ data, 16]", "input y: f32[6, 16]").replace("loss: mse(y)", "relu()"))
    assert (d.code, at(d)) == ("E016", (4, 1, 4, 20))
    assert d.message == "input `y` has batch size 6, but `x` has 8"
    assert labels(d) == [((3, 1, 3, 27), "batch size 8 declared here")]


# ---- E017: shardings that do not line up ----------------------------------------------------


def test_e017_contraction_over_features_split_unlike_the_kernel() -> None:
    d = only(spec("up: linear(16, 16, bias=false) shard kernel[_, model]", "down: linear(16, 16)", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E017", ERROR)
    assert at(d) == (7, 9, 7, 23)
    assert d.message == (
        "contraction shardings of `down` do not line up: its input's features are split over `model` "
        "but `kernel`'s input dimension is replicated"
    )
    assert labels(d) == [((6, 3, 6, 56), "features split over `model` here")]
    assert d.help == "shard `kernel` as [model, _] (row parallel), or gather the activation first with `layout`"


def test_e017_norm_over_split_features() -> None:
    d = only(spec("up: linear(16, 16, bias=false) shard kernel[_, model]", "ln: layernorm(16)"))
    assert (d.code, at(d)) == ("E017", (7, 7, 7, 20))
    assert d.message == "`ln` normalises over features that are split over `model`"


def test_e017_residual_branch_changes_the_sharding() -> None:
    d = only(spec("residual {", "  up: linear(16, 16, bias=false) shard kernel[_, model]", "}"))
    assert (d.code, at(d)) == ("E017", (6, 3, 8, 4))
    assert d.message == (
        "a residual branch must keep its input's sharding, but it turns f32[8@data, 16] into f32[8@data, 16@model]"
    )


def test_e017_targets_sharded_unlike_the_logits() -> None:
    text = dedent("""
        model m
        mesh data=2
        input x: i32[8 @ data, 4]
        input t: i32[8, 4]
        forward(x) {
          embed: embed(32, 16)
          head: linear(16, 32)
          loss: cross_entropy(t)
        }
    """)
    d = only(text)
    assert (d.code, at(d)) == ("E017", (8, 9, 8, 25))
    assert d.message == "targets `t` are sharded i32[8, 4] but the logits are f32[8@data, 4, 32]"
    assert labels(d) == [((4, 1, 4, 19), "targets declared here"), ((7, 3, 7, 23), "logits produced here")]


def test_e017_bias_split_unlike_its_kernel_says_how_to_shard_it() -> None:
    d = only(
        spec("up: linear(16, 16) shard kernel[_, model]", "down: linear(16, 16, bias=false) shard kernel[model, _]")
    )
    assert (d.code, at(d)) == ("E017", (6, 7, 6, 21))
    assert (
        d.message == "`bias` of `up` is replicated but must be split over `model`: it is added to the kernel's output"
    )
    assert d.help == "shard it as `bias[model]`"


def test_e017_attention_bias_split_unlike_its_projection() -> None:
    text = spec(
        "attn: attention(16, 4, bias=true) shard q[_, model], q_bias[model], k[_, model], k_bias[model], "
        "v[_, model], v_bias[model], o[model, _], o_bias[model]",
        "loss: mse(y)",
        header=HEADER.replace("[8 @ data, 16]", "[8 @ data, 4, 16]"),
    )
    d = only(text)
    assert d.code == "E017"
    assert d.message == (
        "`o_bias` of `attn` is split over `model` but must be replicated: it is added to the output of `o`"
    )
    assert written(d, text) == "o_bias[model]"


def test_e016_position_table_shorter_than_the_sequence() -> None:
    d = only(
        spec("pos: position_embed(2, 16)", "loss: mse(y)", header=HEADER.replace("[8 @ data, 16]", "[8 @ data, 4, 16]"))
    )
    assert (d.code, at(d)) == ("E016", (6, 23, 6, 24))  # the `2`
    assert d.message == "`pos` holds 2 positions, but its input has 4: f32[8@data, 4, 16]"
    assert d.help == "make the table at least 4 positions long, or the sequence at most 2"


def test_e017_position_table_split_along_positions() -> None:
    d = only(spec("pos: position_embed(8, 16) shard table[model, _]", "loss: mse(y)"))
    assert d.code == "E017"
    assert d.message.startswith("`table` of `pos` is split over `model` but must be replicated")


def test_e016_and_e017_a_loss_mask_laid_out_unlike_its_targets() -> None:
    header = "model m\nmesh data=2\ninput x: i32[8 @ data, 4]\ninput t: i32[8 @ data, 4]\n"
    body = ("embed: embed(32, 16)", "head: linear(16, 32)", "loss: cross_entropy(t, mask=m)")
    text = spec(*body, header=header + "input m: i8[8 @ data, 5]\n")
    shaped = only(text)
    assert shaped.code == "E016"
    assert shaped.message == "mask `m` must be shaped like the targets: mask i8[8@data, 5], targets i32[8@data, 4]"
    assert written(shaped, text) == "mask=m"
    sharded = only(spec(*body, header=header + "input m: i8[8, 4]\n"))
    assert sharded.code == "E017" and sharded.help == "shard the mask like the targets"


# ---- E018-E022: pipelines and batches -------------------------------------------------------

PIPELINE_HEADER = "model m\nmesh data=1, stage=2\ninput x: f32[8 @ data, 16]\ninput y: f32[8 @ data, 16]\n"


def test_e018_stage_blocks_do_not_match_the_pipeline() -> None:
    text = spec(
        "stage { relu() }",
        "stage { relu() }",
        "stage { relu() }",
        header=PIPELINE_HEADER,
        after="pipeline stage { microbatches 8 }\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("E018", ERROR)
    assert at(d) == (6, 3, 6, 19)
    assert d.message == (
        "the spec writes 3 stages, but the pipeline axis `stage` has size 2 and `virtual` is 1, which makes 2 chunks"
    )
    assert labels(d) == [((10, 1, 10, 34), "pipeline declared here")]


def test_e018_pipeline_without_stages() -> None:
    d = only(spec("relu()", header=PIPELINE_HEADER, after="pipeline stage { microbatches 8 }\n"))
    assert (d.code, at(d)) == ("E018", (8, 1, 8, 34))
    assert "size 2 (x 1 virtual), but the forward body marks no stages" in d.message


def test_e019_layers_do_not_split_evenly_into_stages() -> None:
    text = spec(
        "stages {", "  repeat 3 relu()", "}", header=PIPELINE_HEADER, after="pipeline stage { microbatches 8 }\n"
    )
    d = only(text)
    assert (d.code, d.severity) == ("E019", ERROR)
    assert at(d) == (6, 3, 8, 4)
    assert d.message == "3 layers cannot be split evenly into 2 pipeline chunks (2 stages x 1 virtual)"
    assert d.notes == ("3 layers split evenly into 1, 3 chunks",)


def test_e020_batch_not_divisible_by_accumulation_microbatches_and_data() -> None:
    text = spec(
        "stages {",
        "  repeat 2 relu()",
        "}",
        header=PIPELINE_HEADER.replace("data=1", "data=2"),
        after="pipeline stage { microbatches 8 }\ntrain { accumulate 2 }\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("E020", ERROR)
    assert at(d) == (3, 1, 3, 27)
    assert d.message == (
        "batch size 8 cannot be split into 2 accumulation steps x 8 microbatches x 2 data-parallel shards (= 32)"
    )
    assert labels(d) == [((11, 1, 11, 23), "accumulate 2"), ((10, 1, 10, 34), "microbatches 8")]
    assert d.notes == ("8 / 2 data shards = 4 per shard, which splits evenly into 1, 2, 4",)


def test_e021_unknown_schedule() -> None:
    text = spec(
        "stages {",
        "  repeat 2 relu()",
        "}",
        header=PIPELINE_HEADER,
        after="pipeline stage {\n  schedule 1f1c\n  microbatches 8\n}\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("E021", ERROR)
    assert at(d) == (11, 12, 11, 16)
    assert d.message == "unknown pipeline schedule `1f1c`"
    assert d.help == "did you mean `1f1b`?"


def test_e022_interleaved_needs_microbatches_a_multiple_of_stages() -> None:
    text = spec(
        "stages {",
        "  repeat 4 relu()",
        "}",
        header=PIPELINE_HEADER.replace("8 @ data", "9 @ data"),
        after="pipeline stage {\n  schedule interleaved-1f1b\n  microbatches 3\n  virtual 2\n}\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("E022", ERROR)
    assert at(d) == (10, 1, 14, 2)
    assert "microbatches must be a multiple of 2, got 3" in d.message
    assert d.notes == ("2 stages (`stage`), 3 microbatches, virtual 2",)


def test_e022_virtual_stages_only_for_interleaved() -> None:
    text = spec(
        "stages {",
        "  repeat 4 relu()",
        "}",
        header=PIPELINE_HEADER,
        after="pipeline stage {\n  schedule 1f1b\n  microbatches 8\n  virtual 2\n}\n",
    )
    d = only(text)
    assert (d.code, at(d)) == ("E022", (10, 1, 14, 2))
    assert "virtual=2" in d.message and "interleaved-1f1b" in d.message
    assert d.help is not None and "`virtual 1`" in d.help and "--set v=1" in d.help


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


# ---- E030, E031: schedule tables from files, and pipelines dslc plans but does not run -----------


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


def saved(kind: str, stages: int, microbatches: int) -> dict[str, object]:
    """What `dslc schedule --format json` prints for this table."""
    from dslc.schedules import build, to_json

    return json.loads(json.dumps(to_json(build(kind, stages, microbatches))))


def test_e030_a_saved_table_given_back_is_clean(tmp_path: Path) -> None:
    assert diagnose(table_spec(tmp_path, saved("zb-h1", 2, 8))) == []


def test_e030_an_action_before_its_input_names_the_stage_tick_and_action(tmp_path: Path) -> None:
    table = saved("1f1b", 2, 8)
    stage_1 = table["actions"][1]  # type: ignore[index]
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
    rows = table["actions"]  # type: ignore[index]
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


def test_e030_a_missing_file() -> None:
    d = only(spec(after='pipeline stage {\n  schedule file "nowhere/table.json"\n}\n', header=PIPELINE_HEADER))
    assert (d.code, at(d)) == ("E030", (10, 3, 10, 37))
    assert d.message == "cannot read the schedule file `nowhere/table.json`: No such file or directory"


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
    text = staged("1f1b", 1 << 20, batch=1 << 20)
    d = only(text)
    assert (d.code, at(d)) == ("E031", (10, 1, 13, 2))
    assert "has 4,194,304 actions, more than the 262,144 dslc builds" in d.message
    assert dslc.analyze(text, running=False).ok


def test_e031_v_half_too_large_even_to_plan() -> None:
    text = staged("v-half", 1 << 16, batch=1 << 16)
    planned = dslc.analyze(text, running=False).diagnostics
    assert [d.code for d in planned] == ["E031"]
    assert "has no closed form to plan by" in planned[0].message


# ---- E023: --mesh --------------------------------------------------------------------------


def test_e023_mesh_argument_with_the_wrong_number_of_sizes() -> None:
    d = only(spec(), mesh="2x2x2")
    assert (d.code, d.severity) == ("E023", ERROR)
    assert at(d) == (2, 1, 2, 21)
    assert d.message == "--mesh 2x2x2 gives 3 sizes, but the spec's mesh has 2 axes (data, model)"
    assert d.help == "pass one size per axis, in order: --mesh NxN"


def test_e023_counts_one_size_as_one() -> None:
    assert only(spec(), mesh="2").message == "--mesh 2 gives 1 size, but the spec's mesh has 2 axes (data, model)"


def test_e023_mesh_axis_without_a_size() -> None:
    d = only(spec().replace("mesh data=2, model=2", "mesh data, model=2"))
    assert (d.code, at(d), d.message) == ("E023", (2, 6, 2, 10), "mesh axis `data` has no size")
    assert diagnose(spec().replace("mesh data=2, model=2", "mesh data, model=2"), mesh="2x2") == []


def test_e023_an_axis_across_nodes_that_do_not_split_it() -> None:
    across = spec().replace("mesh data=2, model=2", "mesh data=4 across 4 nodes, model=2")
    assert diagnose(across) == [] and diagnose(across, mesh="8x1") == []
    d = only(across, mesh="2x2")
    assert (d.code, at(d)) == ("E023", (2, 20, 2, 21))
    assert d.message == "mesh axis `data` of size 2 cannot span 4 nodes: each node must hold the same share of it"
    assert d.help == "a node count that divides 2 (1, 2), or a size that 4 divides"
    d = only(spec().replace("mesh data=2, model=2", "mesh data=2, model=2 across 0 nodes"))
    assert (d.code, d.message) == ("E023", "mesh axis `model` must span at least 1 node, got 0")


def test_e023_mesh_given_to_a_spec_without_axes() -> None:
    text = "model m\ninput x: f32[8, 16]\nforward(x) {\n  relu()\n}\n"
    d = only(text, mesh="2x2")
    assert (d.code, at(d)) == ("E023", (1, 1, 6, 1))
    assert d.message == "--mesh 2x2 was given, but the spec declares no mesh axes"


# ---- E024: arguments -------------------------------------------------------------------------


def test_e024_unknown_keyword_suggests_the_closest() -> None:
    d = only(spec("fc: linear(16, 16, bais=false)", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E024", ERROR)
    assert at(d) == (6, 22, 6, 26)
    assert d.message == "`linear` has no argument `bais`"
    assert d.notes == ("`linear` arguments: in, out, bias",)
    assert d.help == "did you mean `bias`?"


def test_e024_too_many_positional_arguments() -> None:
    d = only(spec("fc: linear(16, 16, true, 4)", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E024", (6, 28, 6, 29))
    assert d.message == "`linear` takes 3 positional arguments, but 4 were given"


def test_e024_missing_arguments_are_reported_together() -> None:
    d = only(spec("fc: linear()", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E024", (6, 7, 6, 15))
    assert d.message == "`linear` needs arguments `in` (input features) and `out` (output features)"


def test_e024_argument_given_twice() -> None:
    d = only(spec("fc: linear(16, 16, in=16)", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E024", (6, 22, 6, 27), "argument `in` is given twice")
    assert labels(d) == [((6, 14, 6, 16), "first given here")]


def test_e024_positional_after_keyword_is_one_mistake() -> None:
    d = only(spec("fc: linear(in=16, 16)", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == (
        "E024",
        (6, 21, 6, 23),
        "a positional argument cannot follow keyword arguments",
    )


def test_e024_argument_of_the_wrong_type_is_shown_as_written() -> None:
    d = only(spec("fc: linear(16, true)", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E024", (6, 18, 6, 22), "`out` of `linear` is an integer, got true")
    d = only(spec("fc: linear(16, 16, bias=3)", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E024", (6, 27, 6, 28), "`bias` of `linear` is true or false, got 3")


def test_e024_non_positive_size() -> None:
    d = only(spec("fc: linear(16, 8 - 8)", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E024", (6, 18, 6, 23), "`out` of `linear` must be positive, got 0")


def test_e024_arguments_that_clash_with_each_other() -> None:
    d = only(spec("dropout(1.5)", "loss: mse(y)"))
    # At the argument that is out of range, or that clashes with the others.
    assert (d.code, at(d), d.message) == ("E024", (6, 11, 6, 14), "dropout rate must be in [0, 1), got 1.5")
    d = only(spec("attention(48, 4, kv_heads=3)", header=ATTENTION_HEADER))
    assert (d.code, at(d)) == ("E024", (6, 20, 6, 30))
    assert d.message == "heads (4) must be a multiple of kv_heads (3) for grouped-query attention"
    assert d.notes[0] == "kv_heads must divide heads = 4: 1, 2 or 4"
    # head_dim left to its default (48 / 4 = 12 is even; 36 / 4 = 9 is not): at `rope=true`.
    d = only(spec("attention(36, 4, rope=true)", header=ATTENTION_HEADER.replace("48", "36")))
    assert (d.code, at(d)) == ("E024", (6, 20, 6, 29))
    assert d.message == "rotary embeddings rotate pairs of features, so head_dim must be even, got 9"


def test_e024_block_arguments() -> None:
    header = HEADER + "block mlp(d, hidden=64) {\n  linear(d, hidden)\n  linear(hidden, d)\n}\n"
    d = only(spec("mlp(16, hiden=32)", "loss: mse(y)", header=header))
    assert (d.code, at(d), d.message, d.help) == (
        "E024",
        (10, 11, 10, 16),
        "block `mlp` has no argument `hiden`",
        "did you mean `hidden`?",
    )
    d = only(spec("mlp()", "loss: mse(y)", header=header))
    assert (d.code, at(d), d.message) == ("E024", (10, 3, 10, 8), "block `mlp` needs argument `d`")


def test_e024_repeat_count_out_of_range() -> None:
    d = only(spec("repeat 0 relu()", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E024", (6, 10, 6, 11), "repeat count must be between 1 and 4096, got 0")


# ---- E025: arithmetic ------------------------------------------------------------------------


def test_e025_division_by_zero() -> None:
    d = only("model m\nconst a = 8 // (2 - 2)\ninput x: f32[8, 16]\nforward(x) {\n  relu()\n}\n")
    assert (d.code, d.severity, at(d), d.message) == ("E025", ERROR, (2, 17, 2, 22), "division by zero")


def test_e025_a_fractional_constant_where_an_integer_is_needed() -> None:
    # A constant may hold a fraction (a dropout rate, an epsilon); it is refused only where a
    # dimension needs an integer, at the use, naming the constant.
    assert diagnose(spec(header=HEADER + "const rate = 0.1\n")) == []
    d = only("model m\nconst rate = 0.1\ninput x: f32[8, rate]\nforward(x) {\n  relu()\n}\n")
    assert (d.code, at(d)) == ("E025", (3, 17, 3, 21))
    assert d.message == "`rate` is a number with a fraction, but an integer is needed here"


def test_e025_number_too_large() -> None:
    d = only("model m\nconst a = 4294967296 * 4294967296\ninput x: f32[8, 16]\nforward(x) {\n  relu()\n}\n")
    assert (d.code, at(d), d.message) == ("E025", (2, 11, 2, 34), "number too large")
    assert d.notes == ("the largest allowed magnitude is 2**62 = 4611686018427387904",)


def test_e025_non_positive_dimension_and_no_cascade() -> None:
    d = only(spec().replace("input x: f32[8 @ data, 16]", "input x: f32[8 @ data, 16 - 16]"))
    assert (d.code, at(d), d.message) == ("E025", (3, 24, 3, 31), "dimensions must be positive, got 0")


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


# ---- E026: settings --------------------------------------------------------------------------


def test_e026_unknown_train_setting() -> None:
    d = only(spec(after="train {\n  zer 1\n}\n"))
    assert (d.code, d.severity) == ("E026", ERROR)
    assert at(d) == (10, 3, 10, 6)
    assert d.message == "unknown `train` setting `zer`"
    assert d.help == "did you mean `zero`?"


def test_e026_value_out_of_range() -> None:
    d = only(spec(after="train {\n  zero 4\n}\n"))
    assert (d.code, at(d), d.message) == ("E026", (10, 8, 10, 9), "`zero` must be between 0 and 3, got 4")


def test_e026_precision_that_is_not_a_name() -> None:
    d = only(spec(after="train {\n  compute_dtype 16\n}\n"))
    assert (d.code, at(d), d.message) == (
        "E026",
        (10, 17, 10, 19),
        "`compute_dtype` takes one precision: f32, bf16, f16",
    )


def test_e026_unknown_optimizer_setting() -> None:
    d = only(spec(after="train {\n  optimizer adamw(lr=1e-3, betas=2)\n}\n"))
    assert (d.code, at(d), d.message) == ("E026", (10, 28, 10, 33), "unknown `adamw` setting `betas`")


def test_e026_pipeline_without_microbatches_and_no_cascade() -> None:
    text = spec(
        "stages {", "  repeat 2 relu()", "}", header=PIPELINE_HEADER, after="pipeline stage {\n  schedule gpipe\n}\n"
    )
    d = only(text)
    assert (d.code, at(d), d.message) == ("E026", (10, 1, 12, 2), "the pipeline needs `microbatches N`")


def test_e026_master_copy_of_parameters_that_are_already_f32() -> None:
    d = only(spec(after="train {\n  param_dtype f32\n  master_dtype f32\n}\n"))
    assert (d.code, at(d)) == ("E026", (11, 3, 11, 19))
    assert d.message.startswith("`master_dtype f32` keeps an f32 master copy of 16-bit parameters")
    assert [label.message for label in d.labels] == ["parameters kept in f32 here"]
    assert d.help is not None and "param_dtype bf16" in d.help


def test_e026_master_copy_narrower_than_f32() -> None:
    d = only(spec(after="train {\n  param_dtype bf16\n  master_dtype f16\n}\n"))
    assert (d.code, at(d)) == ("E026", (11, 16, 11, 19))
    assert d.message == "`master_dtype` keeps an f32 master copy of 16-bit parameters: it is f32, not f16"


def test_e026_gradients_summed_in_f32_beside_f32_parameters() -> None:
    d = only(spec(after="train {\n  grad_dtype f32\n}\n"))
    assert (d.code, at(d)) == ("E026", (10, 3, 10, 17))
    assert d.message.startswith("`grad_dtype f32` sums the gradients of 16-bit parameters in f32")
    assert d.notes == ("parameters are f32 unless `param_dtype` says otherwise",)
    assert d.help is not None and "param_dtype bf16" in d.help


def test_e026_gradients_summed_narrower_than_f32() -> None:
    d = only(spec(after="train {\n  param_dtype bf16\n  grad_dtype bf16\n}\n"))
    assert (d.code, at(d)) == ("E026", (11, 14, 11, 18))
    assert d.message == "`grad_dtype` sums the gradients of 16-bit parameters in f32: it is f32, not bf16"


def test_e026_unknown_checkpoint_policy() -> None:
    header = HEADER + "block b(d) checkpoint fast {\n  linear(d, d)\n}\n"
    d = only(spec("b(16)", "loss: mse(y)", header=header))
    assert (d.code, at(d), d.message) == ("E026", (5, 23, 5, 27), "unknown checkpoint policy `fast`")
    assert d.notes == ("known: `core_attention`, `full`, `none`, `selective`",)


def test_e026_core_attention_on_a_block_without_attention() -> None:
    header = HEADER + "block b(d) checkpoint core_attention {\n  linear(d, d)\n}\n"
    d = only(spec("b(16)", "loss: mse(y)", header=header))
    assert (d.code, at(d)) == ("E026", (5, 12, 5, 37))
    assert (
        d.message
        == "block `b` has no attention layer of its own whose core `checkpoint core_attention` could recompute"
    )
    assert d.help is not None and "checkpoint full" in d.help


def test_e026_core_attention_on_a_block_whose_attention_is_a_ring() -> None:
    header = (
        "model m\nmesh context=2, model=2\n"
        "input x: f32[16, 4 @ context, 48]\ninput y: f32[16, 4 @ context, 48]\n"
        "block b() checkpoint core_attention {\n"
        "  attn: attention(48, 4, causal=false) shard q[_, model], k[_, model], v[_, model], o[model, _]\n"
        "}\n"
    )
    d = only(spec("blk: b()", "loss: mse(y)", header=header))
    assert d.code == "E026"
    assert d.notes == ("`blk.attn` is ring attention, which keeps no scores",)


# ---- E027: weight sharding clauses -----------------------------------------------------------


def test_e027_unknown_weight() -> None:
    d = only(spec("fc: linear(16, 16) shard kernal[_, model]", "loss: mse(y)"))
    assert (d.code, d.severity) == ("E027", ERROR)
    assert at(d) == (6, 28, 6, 34)
    assert d.message == "`linear` has no weight `kernal`"
    assert d.notes == ("its weights: `kernel`, `bias`",)
    assert d.help == "did you mean `kernel`?"


def test_e027_a_weight_other_arguments_would_give_may_be_sharded() -> None:
    """One spec serves both settings of a bias switched by a constant: the clause applies when
    the weight exists. A name the layer kind never has is still an error."""
    header = HEADER.replace("input y", "const biased = false\ninput y")
    text = spec(
        "fc: linear(16, 16, bias=biased) shard kernel[_, model], bias[model]",
        "down: linear(16, 16, bias=false) shard kernel[model, _]",
        "loss: mse(y)",
        header=header,
    )
    assert diagnose(text) == []
    assert dslc.check(text, overrides={"biased": True}) == []
    d = only(spec("fc: linear(16, 16, bias=false) shard kernel[_, model], bais[model]", "loss: mse(y)"))
    assert (d.code, d.message, d.help) == ("E027", "`linear` has no weight `bais`", "did you mean `bias`?")


def test_e027_wrong_number_of_dimensions() -> None:
    d = only(spec("fc: linear(16, 16) shard kernel[model]", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E027", (6, 28, 6, 41))
    assert d.message == "weight `kernel` of `linear` has 2 dimensions [16, 16], but the clause gives 1"
    assert d.help == "give one entry per dimension, `_` for replicated: kernel[_, _]"


def test_e027_weight_sharded_twice() -> None:
    d = only(spec("fc: linear(16, 16, bias=false) shard kernel[_, _], kernel[_, _]", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E027", (6, 54, 6, 66), "weight `kernel` is sharded twice")
    assert labels(d) == [((6, 40, 6, 52), "first sharded here")]


def test_e027_shard_on_a_block() -> None:
    header = HEADER + "block b(d) {\n  linear(d, d)\n}\n"
    d = only(spec("b(16) shard kernel[_, model]", "loss: mse(y)", header=header))
    assert (d.code, at(d)) == ("E027", (9, 15, 9, 31))
    assert d.message == "`shard` applies to the weights of a built-in layer, not to a block"


# ---- E032, E033: tied weights ------------------------------------------------------------------


def test_tied_weights_check_clean() -> None:
    """A square kernel read transposed by a later layer: column parallel there, row parallel
    here, so the two chain like a Megatron MLP."""
    text = spec(
        "a: linear(16, 16, bias=false) shard kernel[_, model]",
        "b: linear(16, 16, bias=false) tie kernel = a.kernel.T",
        "loss: mse(y)",
    )
    assert diagnose(text) == []


def test_e032_tie_to_an_unknown_weight_suggests_the_closest() -> None:
    d = only(spec("a: linear(16, 16)", "b: linear(16, 16) tie kernel = a.kernal", "loss: mse(y)"))
    assert (d.code, d.severity, at(d)) == ("E032", ERROR, (7, 34, 7, 42))
    assert d.message == "`b.kernel` is tied to `a.kernal`, but no weight `a.kernal` is declared above it"
    assert d.help == "did you mean `a.kernel`?"
    # A weight declared further down is not above it either.
    d = only(spec("b: linear(16, 16) tie kernel = a.kernel", "a: linear(16, 16)", "loss: mse(y)"))
    assert (d.code, d.message) == (
        "E032",
        "`b.kernel` is tied to `a.kernel`, but no weight `a.kernel` is declared above it",
    )


def test_e032_tie_inside_a_block_and_to_a_repeat() -> None:
    header = HEADER + "block blk(d) {\n  inner: linear(d, d) tie kernel = a.kernel\n}\n"
    d = only(spec("a: linear(16, 16)", "u: blk(16)", "loss: mse(y)", header=header))
    assert (d.code, at(d)) == ("E032", (6, 27, 6, 44))
    assert d.message == "`u.inner.kernel` is tied inside a block or repeat, whose layers read only their own weights"
    d = only(spec("r: repeat 2 linear(16, 16)", "b: linear(16, 16) tie kernel = r.kernel", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E032", (7, 34, 7, 42))
    assert d.message == "`b.kernel` is tied to `r.kernel`, a weight of a repeat: each of its layers has its own"
    assert labels(d) == [((6, 15, 6, 29), "declared here, inside a repeat")]


def test_e032_bad_tie_clauses() -> None:
    d = only(spec("a: linear(16, 16)", "b: linear(16, 16) tie kernal = a.kernel", "loss: mse(y)"))
    assert (d.code, at(d), d.message, d.help) == (
        "E032",
        (7, 25, 7, 31),
        "`linear` has no weight `kernal` to tie",
        "did you mean `kernel`?",
    )
    d = only(spec("a: linear(16, 16)", "b: linear(16, 16) tie kernel = a.kernel shard kernel[_, _]", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E032", (7, 49, 7, 61))
    assert d.message == "weight `kernel` is tied and sharded: a tied weight is split as the weight it reads"
    assert labels(d) == [((7, 25, 7, 42), "tied here")]
    d = only(spec("a: linear(16, 16)", "b: linear(16, 16) tie kernel = a.kernel, kernel = a.kernel", "loss: mse(y)"))
    assert (d.code, at(d), d.message) == ("E032", (7, 44, 7, 61), "weight `kernel` is tied twice")
    header = HEADER + "block blk(d) {\n  linear(d, d)\n}\n"
    d = only(spec("a: linear(16, 16)", "blk(16) tie kernel = a.kernel", "loss: mse(y)", header=header))
    assert (d.code, d.message) == ("E032", "`tie` applies to the weights of a built-in layer, not to a block")


def test_e033_tied_shapes_differ_and_say_whether_to_transpose() -> None:
    d = only(spec("a: linear(16, 32)", "b: linear(32, 16, bias=false) tie kernel = a.kernel", "loss: mse(y)"))
    assert (d.code, d.severity, at(d)) == ("E033", ERROR, (7, 46, 7, 54))
    assert d.message == "`b.kernel` is [32, 16], but `a.kernel` it is tied to is [16, 32]"
    assert labels(d) == [((6, 6, 6, 20), "`a.kernel` declared here: [16, 32]")]
    assert d.help == "read it transposed: `a.kernel.T`"
    d = only(spec("a: linear(16, 32)", "b: linear(16, 32) tie kernel = a.kernel.T", "loss: mse(y)"))
    assert (d.code, d.help) == ("E033", "read it as it is: drop the `.T`")
    d = only(spec("a: linear(16, 16)", "b: linear(16, 32) tie kernel = a.kernel.T", "loss: mse(y)"))
    assert (d.code, d.help) == ("E033", "make the two layers' sizes agree")
    d = only(spec("a: linear(16, 16)", "b: layernorm(16) tie scale = a.bias.T", "loss: mse(y)"))
    assert (d.code, d.message) == ("E033", "`b.scale` reads `a.bias` transposed, but only a matrix can be: it is [16]")


TOKENS = "model m\nmesh data=2, model=2\ninput t: i32[8 @ data, 4]\ninput y: i32[8 @ data, 4]\n"


def test_e033_a_padded_vocabulary_read_where_its_padding_cannot_be_masked() -> None:
    """63 tokens over model=2 are padded to 64: a head right before cross_entropy may read the
    table (the loss masks the extra logit); a layer feeding anything else may not."""
    fine = (
        "forward(t) {\n  wte: embed(63, 16) shard table[model, _]\n"
        "  head: linear(16, 63, bias=false) tie kernel = wte.table.T\n  loss: cross_entropy(y)\n}\n"
    )
    assert diagnose(TOKENS + fine) == []
    text = TOKENS + fine.replace("  loss:", "  gelu()\n  loss:")
    d = only(text)
    assert (d.code, at(d)) == ("E033", (7, 40, 7, 60))
    assert d.message == (
        "`head.kernel` reads `wte.table`, whose vocabulary is padded to 64, "
        "where this layer cannot leave the padding out"
    )


def test_cross_entropy_classes_must_fit_the_logits() -> None:
    body = "forward(t) {\n  wte: embed(16, 8)\n  head: linear(8, 16)\n  loss: cross_entropy(y, classes=17)\n}\n"
    d = only(TOKENS + body)
    assert (d.code, at(d)) == ("E016", (8, 26, 8, 36))
    assert d.message == "`loss` counts 17 classes, but its logits have 16: f32[8@data, 4, 16]"
    d = only(TOKENS + body.replace("classes=17", "classes=-1"))
    assert (d.code, d.message) == ("E024", "`classes` of `cross_entropy` is a count, got -1")


# ---- E028: structure -------------------------------------------------------------------------


def test_e028_no_model_declaration() -> None:
    text = spec().removeprefix("model m\n")
    d = only(text)
    assert (d.code, d.severity) == ("E028", ERROR)
    assert at(d) == (1, 1, 8, 1)  # the whole file
    assert d.message == "the spec has no `model NAME` declaration"


def test_e028_no_forward_points_where_it_would_go() -> None:
    d = only(HEADER)
    assert (d.code, at(d), d.message) == ("E028", (4, 27, 4, 28), "the spec has no `forward(...) { ... }` body")


def test_e028_no_model_and_no_forward_are_both_reported() -> None:
    text = HEADER.removeprefix("model m\n")
    assert [(d.code, d.message) for d in diagnose(text)] == [
        ("E028", "the spec has no `model NAME` declaration"),
        ("E028", "the spec has no `forward(...) { ... }` body"),
    ]


def test_e028_empty_spec() -> None:
    d = only("# nothing yet\n")
    assert (d.code, at(d), d.message) == ("E028", (1, 1, 2, 1), "the spec is empty")


def test_e028_layers_after_the_loss_reported_once() -> None:
    d = only(spec("loss: mse(y)", "relu()", "relu()"))
    assert (d.code, at(d), d.message) == ("E028", (7, 3, 7, 9), "layers after the loss are never reached")
    assert labels(d) == [((6, 3, 6, 15), "the loss ends the forward pass here")]


def test_e028_stage_without_a_pipeline() -> None:
    d = only(spec("stage {", "  relu()", "}", "loss: mse(y)"))
    assert (d.code, at(d)) == ("E028", (6, 3, 8, 4))
    assert d.message == "`stage` marks pipeline chunks, but the spec declares no pipeline"


def test_e028_stage_inside_a_residual_and_no_cascade() -> None:
    text = spec(
        "residual {", "  stage { relu() }", "}", header=PIPELINE_HEADER, after="pipeline stage { microbatches 8 }\n"
    )
    d = only(text)  # not also E018 "the forward body marks no stages"
    assert (d.code, at(d)) == ("E028", (7, 5, 7, 21))
    assert d.message == "`stage` marks pipeline chunks and may only appear at the top of `forward`"


def test_e028_block_recursion_shows_the_chain() -> None:
    header = HEADER + "block a(d) {\n  b(d)\n}\nblock b(d) {\n  a(d)\n}\n"
    d = only(spec("a(16)", "loss: mse(y)", header=header))
    assert (d.code, at(d)) == ("E028", (9, 3, 9, 7))
    assert d.message == "block `a` uses itself (a -> b -> a)"
    assert ((5, 7, 5, 8), "defined here") in labels(d)


# ---- E029: unsupported combinations -----------------------------------------------------------


def test_e029_attention_over_a_sequence_split_over_two_non_tensor_parallel_axes() -> None:
    header = (
        "model m\nmesh data=2, context=2, model=2\n"
        "input x: f32[8, 4 @ (data, context), 48]\ninput y: f32[8, 4 @ (data, context), 48]\n"
    )
    attn = "attn: attention(48, 4, causal=false) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    d = only(spec(attn, header=header))
    assert (d.code, d.severity) == ("E029", ERROR)
    assert at(d) == (6, 9, 6, 39)
    assert d.message == (
        "`attn` can pass key/value blocks around one mesh axis, but its sequence is split over (data, context)"
    )
    assert labels(d) == [((3, 1, 3, 41), "split here: f32[8, 4@(data, context), 48]")]


def test_e029_context_parallel_attention_inside_a_pipeline() -> None:
    header = (
        "model m\nmesh context=2, model=2, stage=2\n"
        "input x: f32[16, 4 @ context, 48]\ninput y: f32[16, 4 @ context, 48]\n"
    )
    attn = "attention(48, 4, causal=false) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    text = spec(
        "stage {",
        f"  a1: {attn}",
        "}",
        "stage {",
        f"  a2: {attn}",
        "  loss: mse(y)",
        "}",
        header=header,
        after="pipeline stage {\n  schedule 1f1b\n  microbatches 8\n}\n",
    )
    diags = diagnose(text)
    assert [d.code for d in diags] == ["E029", "E029"], shown(diags, text)
    d = diags[0]
    assert (d.code, d.severity) == ("E029", ERROR)
    assert "does not run inside a pipeline stage yet" in d.message
    assert labels(d)[0][1] == "pipelined over `stage` here"


def test_e014_causal_context_parallel_sequence_not_in_two_chunks_per_device() -> None:
    header = "model m\nmesh data=2, model=2\ninput x: f32[8, 6 @ data, 48]\ninput y: f32[8, 6 @ data, 48]\n"
    attn = "attn: attention(48, 4) shard q[_, model], k[_, model], v[_, model], o[model, _]"
    d = only(spec(attn, header=header))
    assert (d.code, at(d)) == ("E014", (6, 9, 6, 25))
    assert d.message == (
        "`attn` splits its 6 tokens into 2 x data=2 = 4 equal chunks for causal context parallelism, "
        "but 6 does not split evenly into 4"
    )


def test_e029_convolution_over_a_split_image() -> None:
    text = "model m\nmesh data=2\ninput x: f32[8, 4 @ data, 4, 3]\nforward(x) {\n  c: conv(3, 8)\n}\n"
    d = only(text)
    assert (d.code, at(d)) == ("E029", (5, 6, 5, 16))
    assert d.message == "`c` cannot convolve an image split along its spatial dimensions"


# ---- W001-W005: legal but wasteful -----------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "head_dim", "backend", "said"),
    [
        ("", 16, "gpu", "takes 16-bit heads, these are float32"),
        ("train { compute_dtype bf16 }\n", 160, "gpu", "a width up to 128 in steps of 8, not 160"),
        ("", 16, "tpu", None),
        ("train { compute_dtype bf16 }\n", 16, "gpu", None),
        ("", 16, "cpu", None),
    ],
)
def test_w005_a_layer_no_fused_kernel_takes_on_the_backend(
    train: str, head_dim: int, backend: str, said: str | None
) -> None:
    header = "model m\nmesh data=2\ninput x: f32[2 @ data, 2048, 64]\ninput y: f32[2 @ data, 2048, 64]\n"
    text = header + f"forward(x) {{\n  attn: attention(64, 4, head_dim={head_dim})\n  loss: mse(y)\n}}\n" + train
    assert dslc.check(text) == []  # said only for a backend
    found = dslc.check(text, backend=backend)
    if said is None:
        assert found == []
        return
    (d,) = found
    assert (d.code, d.severity, at(d)) == ("W005", WARNING, (6, 3, 6, 36 + len(str(head_dim))))
    assert said in d.message and d.help


def test_w001_pipeline_efficiency_below_80_percent() -> None:
    text = spec(
        "stages {",
        "  repeat 2 linear(16, 16)",
        "}",
        header=PIPELINE_HEADER,
        after="pipeline stage {\n  schedule gpipe\n  microbatches 2\n}\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("W001", WARNING)
    assert at(d) == (10, 1, 13, 2)
    assert (
        d.message == "pipeline efficiency is 67%: with 2 stages and 2 microbatches, 33% of the gpipe schedule is bubble"
    )
    assert d.help == "use at least 4 microbatches (or an interleaved schedule)"


def test_w002_unbalanced_stages_says_how_much_more_work() -> None:
    text = spec(
        "stage { linear(16, 16) }",
        "stage { relu() }",
        header=PIPELINE_HEADER,
        after="pipeline stage { microbatches 8 }\n",
    )
    d = only(text)
    assert (d.code, d.severity) == ("W002", WARNING)
    assert at(d) == (9, 1, 9, 34)
    # linear: 2 * 8 * 16 * 16 = 4096 FLOPs and 8 * 16 = 128 for its bias; relu: 8 * 16 = 128.
    assert d.message == "pipeline stages are unbalanced: stage 0 does 33x the work of stage 1"
    assert labels(d) == [((6, 11, 6, 25), "stage 0 starts here")]
    assert d.notes == ("forward FLOPs per stage: 0: 4.22e+03, 1: 128",)


def test_w002_under_interleaving_names_the_chunks_and_does_not_label_a_shared_repeat() -> None:
    # 8 chunks on 2 stages (virtual 4), cut from one `repeat`: every chunk starts on its line,
    # so no label can say where the heavy stage starts; the head makes stage 1 heavy.
    text = spec(
        "stages {",
        "  repeat 8 linear(16, 16)",
        "}",
        "head: linear(16, 64)",
        "out: linear(64, 16)",
        "loss: mse(y)",
        header=PIPELINE_HEADER,
        after="pipeline stage {\n  schedule interleaved-1f1b\n  microbatches 8\n  virtual 4\n}\n",
    )
    d = only(text)
    assert d.code == "W002" and d.labels == ()
    assert d.notes[1] == "stage 1 runs chunks 1, 3, 5, 7 (4 per stage)"
    assert d.help is not None and "`stage { }` blocks" not in d.help and "stage 1's chunks" in d.help


def test_w002_small_imbalance_in_percent() -> None:
    text = spec(
        "stage { linear(16, 16) }",
        "stage { linear(16, 16) relu() relu() relu() relu() }",
        header=PIPELINE_HEADER,
        after="pipeline stage { microbatches 8 }\n",
    )
    d = only(text)
    assert d.message == "pipeline stages are unbalanced: stage 1 does 12% more work than stage 0"


def test_w003_large_weights_replicated_on_every_device() -> None:
    header = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 2048]\ninput y: f32[8 @ data, 2048]\n"
    d = only(spec("fc: linear(2048, 2048)", "loss: mse(y)", header=header))
    assert (d.code, d.severity) == ("W003", WARNING)
    assert at(d) == (6, 7, 6, 25)
    assert d.message == "`fc.kernel` f32[2048, 2048] (16 MiB) is replicated on all 4 devices that hold it"


def test_w003_one_warning_per_line_naming_every_weight() -> None:
    header = "model m\nmesh data=2, model=2\ninput x: f32[8 @ data, 4, 2048]\ninput y: f32[8 @ data, 4, 2048]\n"
    d = only(spec("repeat 2 attention(2048, 16)", "loss: mse(y)", header=header))
    assert (d.code, at(d)) == ("W003", (6, 12, 6, 31))
    assert d.message == (
        "`attention.*.q`, `attention.*.k`, `attention.*.v`, `attention.*.o` (128 MiB in all) are replicated "
        "on all 4 devices that hold them"
    )


def test_w004_zero_without_a_data_parallel_axis() -> None:
    text = spec(after="train {\n  zero 1\n}\n").replace("f32[8 @ data, 16]", "f32[8, 16]")
    d = only(text)
    assert (d.code, d.severity) == ("W004", WARNING)
    assert at(d) == (9, 1, 11, 2)
    assert d.message == "ZeRO stage 1 has no data-parallel axis to shard over: the batch is not split"


def test_w004_zero_3_without_checkpoints_keeps_the_gathered_weights() -> None:
    body = "block mlp() CHECKPOINT{\n  up: linear(16, 64)\n  relu()\n  down: linear(64, 16)\n}\n"
    text = spec("layers: repeat 4 mlp()", "loss: mse(y)", after="train {\n  zero 3\n}\n")
    text = text.replace("forward(x)", body + "forward(x)")
    d = only(text.replace("CHECKPOINT", ""), mesh="4x1")
    assert (d.code, d.severity) == ("W004", WARNING)
    # 4 layers x (16 x 64 + 64 x 16) f32 weights, whole on each device: 32 KiB (the biases,
    # added, are not kept).
    assert d.message.startswith("ZeRO stage 3 splits the parameters, but the backward pass keeps 0.03 MiB")
    assert "checkpoint full" in d.help
    # Checkpointed, each layer's backward gathers its weights again: no warning.
    assert not diagnose(text.replace("CHECKPOINT", "checkpoint full "), mesh="4x1")


def test_w004_zero_cannot_split_a_tensor() -> None:
    text = spec("fc: linear(16, 6)", "relu()", after="train {\n  zero 2\n}\n")
    d = only(text, mesh="4x1")
    assert (d.code, at(d)) == ("W004", (6, 7, 6, 20))
    assert d.message == (
        "ZeRO stage 2 cannot split the optimizer state and gradients of `fc.bias` f32[6] over data (size 4): "
        "no dimension divides evenly, so it stays as declared"
    )


# ---- one run, every mistake, each once ---------------------------------------------------------


def test_every_independent_mistake_is_reported_in_one_run() -> None:
    text = dedent("""
        model m
        mesh data=2, model=2
        const d = 16
        input x: f32[8 @ data, d]
        input y: f32[8 @ data, d]
        forward(x) {
          up: lineer(d, d)
          mid: linear(d, d, bais=false)
          down: linear(d, d) shard kernel[modle, _]
          loss: mse(y)
        }
        train {
          zero 5
        }
    """)
    found = [(d.code, at(d)) for d in diagnose(text)]
    assert found == [
        ("E010", (7, 7, 7, 13)),
        ("E024", (8, 21, 8, 25)),
        ("E012", (9, 35, 9, 40)),
        ("E026", (13, 8, 13, 9)),
    ]


def test_a_layer_with_a_bad_argument_still_has_its_shard_axes_checked() -> None:
    text = spec("fc: linear(16, 16, bais=false) shard kernel[modle, _]", "loss: mse(y)")
    assert [(d.code, at(d)) for d in diagnose(text)] == [("E024", (6, 22, 6, 26)), ("E012", (6, 47, 6, 52))]


def test_diagnostics_come_in_source_order() -> None:
    text = spec("fc: linear(16, 16, bais=false)", "loss: mse(yy)", after="train {\n  zer 1\n}\n")
    lines = [d.span.line for d in diagnose(text)]
    assert lines == sorted(lines) and len(lines) == 3


def test_a_block_used_many_times_reports_its_mistake_once_at_the_first_use() -> None:
    header = HEADER + "block mlp(d) {\n  up: linear(d, 4 * d) shard kernel[_, modle]\n  down: linear(4 * d, d)\n}\n"
    diags = diagnose(spec("layers: repeat 12 mlp(16)", "loss: mse(y)", header=header))
    assert len(diags) == 1
    d = diags[0]
    assert (d.code, at(d)) == ("E012", (6, 40, 6, 45))
    # The body's text is shared by all uses, so the report also names the use.
    assert labels(d) == [((10, 21, 10, 28), "in this use of `mlp`")]


def test_a_mistake_caused_by_one_use_of_a_block_points_at_that_use() -> None:
    header = HEADER + "block proj(d_in, d_out) {\n  linear(d_in, d_out)\n}\n"
    diags = diagnose(spec("proj(16, 16)", "proj(8, 16)", "loss: mse(y)", header=header))
    assert len(diags) == 1
    d = diags[0]
    assert (d.code, at(d)) == ("E016", (6, 3, 6, 22))
    assert d.message == "`proj_1.linear` expects 8 input features, but its input has 16 in f32[8@data, 16]"
    assert ((10, 3, 10, 14), "in this use of `proj`") in labels(d)


ONE_MISTAKE = {
    # an unknown layer: the layers after it are not typed against a guess
    "unknown layer": (spec("fc: lineer(16, 32)", "down: linear(32, 16)", "loss: mse(y)"), "E010"),
    # a failed argument: no shape errors for the layer that could not be built
    "bad argument": (spec("fc: linear(16, 16, bias=3)", "ln: layernorm(16)", "loss: mse(y)"), "E024"),
    # a refused axis is dropped: the weight is not split over a guess
    "unknown axis": (spec("fc: linear(16, 16, bias=false) shard kernel[modle, _]", "loss: mse(y)"), "E012"),
    # a refused kernel axis is not also a bias "split unlike its kernel"
    "kernel axis": (spec("fc: linear(16, 16) shard kernel[_, modle], bias[model]", "relu()"), "E012"),
    # a dimension that is not a number: its input is not typed with a placeholder
    "unknown size": (spec().replace("f32[8 @ data, 16]\ninput y", "f32[8 @ data, dd]\ninput y"), "E010"),
    # a refused sharding on the targets does not also make the loss compare shardings
    "bad target axis": (spec().replace("input y: f32[8 @ data", "input y: f32[8 @ dta"), "E012"),
    # a pipeline that cannot be read is not also "no pipeline"
    "bad microbatches": (
        spec("stages {", "  repeat 2 relu()", "}", header=PIPELINE_HEADER, after="pipeline stage { microbatches 0 }\n"),
        "E026",
    ),
    # the loss ends the body: the layers after it are reported once, together
    "after the loss": (spec("loss: mse(y)", "relu()", "gelu()", "relu()"), "E028"),
    # positional after keyword is one slip, not also "given twice"
    "positional after keyword": (spec("fc: linear(in=16, 16)", "loss: mse(y)"), "E024"),
    # a block whose argument is wrong is reported at the block, not at each layer inside
    "block argument": (spec("b(16, 3)", "loss: mse(y)", header=HEADER + "block b(d) {\n  linear(d, d)\n}\n"), "E024"),
}


@pytest.mark.parametrize(("text", "code"), ONE_MISTAKE.values(), ids=ONE_MISTAKE.keys())
def test_one_mistake_gives_one_diagnostic(text: str, code: str) -> None:
    diags = diagnose(text)
    assert [d.code for d in diags] == [code], shown(diags, text)


def test_a_bad_mesh_argument_falls_back_to_the_spec_sizes() -> None:
    text = spec(
        "up: linear(16, 32) shard kernel[_, model], bias[model]",
        "down: linear(32, 16) shard kernel[model, _]",
        "loss: mse(y)",
    )
    assert codes(text) == []
    assert codes(text, mesh="2x2x2") == ["E023"]


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


def test_text_rendering_shows_a_line_once_when_a_label_shares_it() -> None:
    text = spec().replace("input x: f32[8 @ data, 16]", "input x: f32[8 @ data, 16 @ data]")
    assert shown(diagnose(text), text) == (
        "<string>:3:29: error[E013]: mesh axis `data` is used twice in the sharding of input `x`\n"
        " 3 | input x: f32[8 @ data, 16 @ data]\n"
        "   | " + " " * 17 + "---- first used here\n"
        "   | " + " " * 28 + "^^^^\n"
        "   = help: a mesh axis can split at most one dimension of a tensor\n"
    )


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_example_spec_checks_without_errors(path: Path) -> None:
    diags = dslc.check(path)
    assert not [d for d in diags if d.is_error], render_text(diags, {str(path): path.read_text()})


# ---- golden renderings ------------------------------------------------------------------------

GOLDEN_SPECS = sorted(GOLDEN.glob("*.par"))


def test_there_is_a_handful_of_golden_specs() -> None:
    assert 8 <= len(GOLDEN_SPECS) <= 15
    assert {p.stem for p in GOLDEN.glob("*.txt")} == {p.stem for p in GOLDEN_SPECS}, "a .par without .txt or back"


@pytest.mark.parametrize("path", GOLDEN_SPECS, ids=lambda p: p.stem)
def test_rendered_text_matches_golden(path: Path, update_goldens: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Checked from inside the folder under its bare name, so the text holds no absolute path.
    monkeypatch.chdir(GOLDEN)
    diags = dslc.check(path.name)
    output = render_text(diags, {path.name: path.read_text(encoding="utf-8")})
    assert diags and str(GOLDEN) not in output
    expected = path.with_suffix(".txt")
    if update_goldens:
        expected.write_text(output, encoding="utf-8")
    assert output == expected.read_text(encoding="utf-8"), (
        f"{expected.name} changed; review, then rerun with --update-goldens"
    )


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


def test_catalogue_codes_each_have_a_test_here() -> None:
    assert _codes_in_source() - _codes_asserted_here() == set(), "codes no test in this file asserts"
