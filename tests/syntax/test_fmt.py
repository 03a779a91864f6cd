"""`dslc fmt`: canonical, idempotent, faithful to the tree and to every comment."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dslc import cli
from dslc.syntax import ast
from dslc.syntax.format import format_module
from dslc.syntax.parser import parse
from dslc.syntax.source import from_text
from tests.conftest import ROOT

SPECS = sorted((ROOT / "specs").glob("*.par"))


def _parse(text: str) -> ast.Module:
    source, diags = from_text(text)
    assert source is not None, diags
    module, diags = parse(source)
    assert module is not None, diags
    return module


def fmt(text: str) -> str:
    return format_module(_parse(text), text)


def comment_texts(text: str) -> list[str]:
    return [c.text for c in _parse(text).comments]


def assert_faithful(text: str) -> str:
    """Format once and check everything `dslc fmt` promises; returns the formatted text."""
    once = fmt(text)
    assert fmt(once) == once, "formatting is not idempotent"
    assert _parse(once) == _parse(text), "formatting changed the syntax tree"
    assert comment_texts(once) == comment_texts(text), "formatting lost or reordered a comment"
    return once


# ---- tricky inputs -----------------------------------------------------------------------------

TRICKY = {
    "comments_everywhere": """\
# leading comment

# second leading comment, after a blank line
model   m   # trailing after the model
mesh data = 2 ,model=  2 # trailing after the mesh
   # indented comment between items
const d = 4 * 2
input x: f32[8 @ data, d]   # trailing after an input

block b(d, h=2) checkpoint selective ( a , up ) {
  # first in a block
  a: linear(d, d) # trailing in a block
  up: linear(
     d,   # inside a multi-line call
     d
     # alone inside a multi-line call
  ) shard kernel[_, model]
  # last in a block, before its `}`
}
forward(x) {
  residual { gelu() } # after a one-line residual
  repeat 2 b(d)
  layout [ data , _ ]
}
train { zero 1 optimizer adamw(lr=3e-4,
  b1=0.9) # after a multi-line setting
}
# at the end of the file""",
    "comment_at_eof_without_newline": "model m\nforward(x) { gelu() }\n# the end",
    "two_comments_one_statement": "model m\nforward(x) {\n  a: linear(1, # one\n    2) # two\n  b: gelu()\n}\n",
    "comment_inside_empty_body": "model m\ntrain {\n  # nothing to set yet\n}\nforward(x) {}\n",
    "blank_lines": "\n\n\nmodel m\n\n\n\nconst a = 1\nconst b = 2\n\n\n"
    "forward(x) {\n\n  gelu()\n\n\n  relu()\n\n}\n\n\n",
    "expressions": """\
model m
const a = -(-(3))
const b = ((1+2))*3 - (4 - 5) - -a
const c = a - (b - 1)
const d = (a - b) - 1
const e = a * (b // 2) // (3 * 4)
const f = -(a + b) * -(-c)
const g = (((a)))
const h = 1_000 + 2
""",
    "one_line_everything": "model m mesh a=2 input x: f32[4 @ a, 4] forward(x) { residual { gelu() relu() } } "
    "pipeline a { schedule interleaved-1f1b microbatches 4 virtual 2 } train { fsdp a }",
    "crlf_and_tabs": "model m\r\n\tconst a = 1\t# tab comment\r\nforward(x) {\r\n\tgelu()\r\n}\r\n",
    "several_axes": "model m\nmesh data=2, fsdp=2, model=2\ninput x: f32[8 @ (data,fsdp), 4 @ model]\n"
    "forward(x) { layout [(data, fsdp), _] }\n",
    "axes_across_nodes": "model m\nmesh data = 4  across 2 nodes ,model , nodes across 1 * 2 nodes\nforward(x) {}\n",
    "floats_and_bools": "model m\ntrain { optimizer adamw(lr=3e-4, b1=0.9, eps=1e-8, warmup=1_0) }\n"
    "forward(x) { a: attention(8, 2, causal=false, rope=true, rope_base=1.e4) }\n",
    "schedule_file": 'model m\npipeline a {\n  schedule   file   "tables/my (v2).json"  # a table\n}\nforward(x) {}\n',
    "only_comments": "# nothing\n\n# here\n",
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_tricky_input_formats_faithfully(name: str) -> None:
    assert_faithful(TRICKY[name])


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_spec_formats_faithfully(spec: Path) -> None:
    assert_faithful(spec.read_text(encoding="utf-8"))


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_spec_is_in_canonical_form(spec: Path) -> None:
    """The shipped specs are what `dslc fmt` would write: they are the style guide."""
    text = spec.read_text(encoding="utf-8")
    assert fmt(text) == text


CANONICAL = """\
# leading comment

# second leading comment, after a blank line
model m  # trailing after the model
mesh data=2, model=2  # trailing after the mesh
# indented comment between items
const d = 4 * 2
input x: f32[8 @ data, d]  # trailing after an input

block b(d, h=2) checkpoint selective(a, up) {
  # first in a block
  a: linear(d, d)  # trailing in a block
  up: linear(d, d) shard kernel[_, model]
  # inside a multi-line call
  # alone inside a multi-line call
  # last in a block, before its `}`
}
forward(x) {
  residual {
    gelu()
  }  # after a one-line residual
  repeat 2 b(d)
  layout [data, _]
}
train {
  zero 1
  optimizer adamw(lr=3e-4, b1=0.9)
  # after a multi-line setting
}
# at the end of the file
"""


def test_canonical_layout() -> None:
    assert fmt(TRICKY["comments_everywhere"]) == CANONICAL


def test_blank_lines_collapse_and_vanish_inside_braces() -> None:
    expected = "model m\n\nconst a = 1\nconst b = 2\n\nforward(x) {\n  gelu()\n\n  relu()\n}\n"
    assert fmt(TRICKY["blank_lines"]) == expected


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("-(-(3))", "-(-3)"),
        ("((1+2))*3", "(1 + 2) * 3"),
        ("a - (b - c)", "a - (b - c)"),
        ("(a - b) - c", "a - b - c"),  # same level on the left: the parentheses say nothing
        ("(a * b) // c", "a * b // c"),
        ("a // (b * c)", "a // (b * c)"),
        ("(a + b) * c", "(a + b) * c"),
        ("a + (b * c)", "a + b * c"),
        ("-(a + b)", "-(a + b)"),
        ("-(a * b)", "-(a * b)"),
        ("- a", "-a"),
        ("a - -b", "a - -b"),
        ("(((a)))", "a"),
    ],
)
def test_expression_parentheses(written: str, canonical: str) -> None:
    assert fmt(f"const v = {written}\n") == f"const v = {canonical}\n"


def test_empty_bodies_print_as_braces() -> None:
    assert fmt("forward(x) {\n}\ntrain {   }\nblock b() {\n\n}\n") == "forward(x) {}\ntrain {}\nblock b() {}\n"


def test_ast_equality_ignores_spans() -> None:
    assert _parse("model m\nconst a = 1 + 2\n") == _parse("\n\n  model   m   const a=1+2 # c\n")
    assert _parse("const a = 1 + 2\n") != _parse("const a = 1 + 3\n")


# ---- the command ----------------------------------------------------------------------------------

UNFORMATTED = "model   m\nforward(x) { gelu() }  # keep me\n"
FORMATTED = "model m\nforward(x) {\n  gelu()\n}  # keep me\n"


def test_fmt_check_exits_1_on_unformatted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.par"
    path.write_text(UNFORMATTED, encoding="utf-8")
    assert cli.main(["fmt", str(path), "--check"]) == 1
    assert "would be reformatted" in capsys.readouterr().err
    assert path.read_text(encoding="utf-8") == UNFORMATTED


def test_fmt_check_exits_0_on_formatted_file(tmp_path: Path) -> None:
    path = tmp_path / "m.par"
    path.write_text(FORMATTED, encoding="utf-8")
    assert cli.main(["fmt", str(path), "--check"]) == 0


def test_fmt_rewrites_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.par"
    path.write_text(UNFORMATTED, encoding="utf-8")
    path.chmod(0o640)
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        assert Path(src).read_text(encoding="utf-8") == FORMATTED  # complete before it lands
        replaced.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", spy)
    assert cli.main(["fmt", str(path)]) == 0
    assert path.read_text(encoding="utf-8") == FORMATTED
    [(src, dst)] = replaced
    assert Path(src).parent == tmp_path and dst == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.par"], "a temporary file was left behind"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_fmt_leaves_formatted_file_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.par"
    path.write_text(FORMATTED, encoding="utf-8")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = path.stat()
    monkeypatch.setattr(cli.os, "replace", lambda *a: pytest.fail("rewrote a formatted file"))
    assert cli.main(["fmt", str(path)]) == 0
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.par"]


def test_fmt_stdout_prints_without_rewriting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.par"
    path.write_text(UNFORMATTED, encoding="utf-8")
    assert cli.main(["fmt", str(path), "--stdout"]) == 0
    assert capsys.readouterr().out == FORMATTED
    assert path.read_text(encoding="utf-8") == UNFORMATTED


@pytest.mark.parametrize("flags", [[], ["--check"], ["--stdout"]])
def test_fmt_refuses_a_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    path = tmp_path / "bad.par"
    broken = b"model m\nforward(x) {\n  gelu(\n}\n"
    path.write_bytes(broken)
    mtime = path.stat().st_mtime_ns
    assert cli.main(["fmt", str(path), *flags]) == 1
    captured = capsys.readouterr()
    assert "error[E001]" in captured.err and f"{path}:4:1" in captured.err
    assert captured.out == ""
    assert path.read_bytes() == broken and path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.par"]


def test_fmt_refuses_a_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.par"
    path.write_bytes(b"model m\xff\n")
    assert cli.main(["fmt", str(path)]) == 1
    assert "error[E002]" in capsys.readouterr().err
    assert path.read_bytes() == b"model m\xff\n"


def test_fmt_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    assert cli.main(["fmt", str(tmp_path / "nope.par")]) == 2
