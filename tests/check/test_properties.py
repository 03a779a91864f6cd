"""Property tests of the front end: programs generated from the grammar itself, and mangled
copies of the shipped specs. Whatever the input, `dslc.check` answers with diagnostics (it
never raises), the CLI exits 0, 1 or 2, and `dslc fmt` is idempotent and faithful.

A fixed, derandomized profile, so CI sees the same examples every run (about 15 s). For a
longer hunt, DSLC_PROPERTY_SCALE=20 multiplies the number of examples and draws fresh ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from lark import Lark

import dslc
from dslc import resources
from dslc.diagnostics import Diagnostic, render_json, render_text
from dslc.syntax import ast
from dslc.syntax.format import format_module
from dslc.syntax.parser import parse
from dslc.syntax.source import from_text
from tests.conftest import ROOT

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SPECS = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "specs").glob("*.par"))}

SCALE = int(os.environ.get("DSLC_PROPERTY_SCALE", "1"))
PROFILE = settings(
    max_examples=150 * SCALE,
    deadline=None,
    derandomize=SCALE == 1,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# ---- programs from the grammar ------------------------------------------------------------------

# Every token is followed by some whitespace, so generated tokens never glue together into
# other tokens (`model` + `m` -> `modelm`); comments end their line. Names come from a pool
# the checker knows (layer kinds, weights, axes, settings) plus a few keywords, which are
# names only where the grammar expects no keyword.
_SEPARATORS = st.sampled_from([" ", " ", " ", "\n", "\t", "\r\n", "  \n\n"])
_NAMES = (
    "x", "d", "tokens", "targets", "data", "model", "stage", "f32", "bf16", "i32",
    "linear", "gelu", "attention", "layernorm", "embed", "cross_entropy", "blk",
    "kernel", "bias", "q", "o", "table", "heads", "dim",
    "adamw", "lr", "zero", "fsdp", "microbatches", "virtual", "accumulate", "full", "selective",
    "a_1", "_b", "residual", "true", "schedule",
)  # fmt: skip


def _token(strategy: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(strategy, _SEPARATORS).map("".join)


def _grammar_strategy() -> st.SearchStrategy[str]:
    grammar = Lark(resources.grammar_path().read_text(encoding="utf-8"), parser="lalr", lexer="contextual")
    explicit: dict[str, st.SearchStrategy[str]] = {
        t.name: _token(st.just(t.pattern.value)) for t in grammar.terminals if t.pattern.type == "str"
    }
    explicit |= {
        "NAME": _token(st.sampled_from(_NAMES)),
        "SCHEDULE_NAME": _token(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb", "x-"])),
        "INT": _token(st.sampled_from(["0", "1", "2", "3", "4", "8", "16", "1_024", "9" * 80])),
        "FLOAT": _token(st.sampled_from(["0.1", "3e-4", "1.", "1e999", "2.5E3", "0.0"])),
        "ADD_OP": _token(st.sampled_from(["+", "-"])),
        "MUL_OP": _token(st.sampled_from(["*", "//"])),
        "COMMENT": st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=8).map(
            lambda s: f"#{s}\n"
        ),
        "WS": st.sampled_from([" ", "\n", "\n\n", "\t", "\r\n"]),
    }
    return from_lark(grammar, explicit=explicit)


PROGRAMS = _grammar_strategy()


def _check_answers_with_diagnostics(text: str, mesh: str | None = None) -> list[Diagnostic]:
    diags = dslc.check(text, mesh=mesh)
    assert isinstance(diags, list)
    assert all(isinstance(d, Diagnostic) for d in diags)
    # What the CLI does with them must not fail either.
    render_text(diags, {"<string>": text})
    render_json(diags)
    return diags


@PROFILE
@given(PROGRAMS)
def test_generated_programs_check_without_raising(text: str) -> None:
    _check_answers_with_diagnostics(text)


def _module(text: str) -> ast.Module | None:
    source, _ = from_text(text)
    return parse(source)[0] if source is not None else None


@PROFILE
@given(PROGRAMS)
def test_generated_programs_format_faithfully(text: str) -> None:
    module = _module(text)
    assume(module is not None)
    assert module is not None
    once = format_module(module, text)
    again = _module(once)
    assert again is not None, f"the formatter wrote text that does not parse:\n{once}"
    assert again == module, "formatting changed the syntax tree"
    assert format_module(again, once) == once, "formatting is not idempotent"
    assert [c.text for c in again.comments] == [c.text for c in module.comments], "a comment was lost"


# ---- mangled specs -----------------------------------------------------------------------------------

_DEEP = [
    "(" * 10_000 + "1" + ")" * 10_000,
    "-" * 10_000 + "1",
    "- " * 3_000 + "1",
    "{" * 10_000,
    "residual { " * 2_000 + "gelu()" + " }" * 2_000,
    "[" * 10_000,
    "1" + " + 1" * 20_000,
]
_NUMBERS = ["1" + "0" * 5_000, "9" * 80, "1e5000", "0", "-1", "4611686018427387905", "1_" * 50 + "1", "0.0"]
_ODD_TEXT = st.one_of(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=8),
    st.sampled_from(["\x00", "\ufeff", "\ud800", "\u2028", "\r", "\x0c", "é", "日本", "🙂", "#", "@", "_", "//", "**"]),
    st.sampled_from(_NUMBERS),
    st.sampled_from(_DEEP),
)
_TOKEN_RE = r"[A-Za-z0-9_.]+|\S"


@st.composite
def mangled_specs(draw: st.DrawFn) -> str:
    import re

    text = SPECS[draw(st.sampled_from(sorted(SPECS)))]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "insert", "truncate", "replace_number"]))
        n = len(text)
        if kind == "delete" and n:
            i = draw(st.integers(0, n - 1))
            text = text[:i] + text[i + draw(st.integers(1, 40)) :]
        elif kind == "duplicate":
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            text = "\n".join(lines[: i + 1] + lines[i:])
        elif kind == "swap":
            tokens = list(re.finditer(_TOKEN_RE, text))
            if len(tokens) >= 2:
                a, b = sorted(draw(st.lists(st.integers(0, len(tokens) - 1), min_size=2, max_size=2, unique=True)))
                ta, tb = tokens[a], tokens[b]
                text = text[: ta.start()] + tb.group() + text[ta.end() : tb.start()] + ta.group() + text[tb.end() :]
        elif kind == "insert":
            i = draw(st.integers(0, n))
            text = text[:i] + draw(_ODD_TEXT) + text[i:]
        elif kind == "truncate":
            text = text[: draw(st.integers(0, n))]
        elif kind == "replace_number":
            numbers = list(re.finditer(r"\b[0-9]+\b", text))
            if numbers:
                m = numbers[draw(st.integers(0, len(numbers) - 1))]
                text = text[: m.start()] + draw(st.sampled_from(_NUMBERS)) + text[m.end() :]
    return text


@settings(PROFILE, max_examples=400 * SCALE)
@given(mangled_specs(), st.sampled_from([None, None, None, "1", "2x2", "1x1x1", "3x5x7", "64x64x64"]))
def test_mangled_specs_check_without_raising(text: str, mesh: str | None) -> None:
    _check_answers_with_diagnostics(text, mesh)


@pytest.mark.parametrize("deep", _DEEP, ids=lambda s: repr(s[:12]))
def test_deep_nesting_is_refused_not_crashed(deep: str) -> None:
    text = f"model m\nconst a = {deep}\ninput x: f32[8, 4]\nforward(x) {{ {deep} }}\n"
    _check_answers_with_diagnostics(text)


def test_every_spec_survives_every_truncation_of_its_first_lines() -> None:
    for text in SPECS.values():
        cut = text[: text.index("forward")]
        for i in range(0, len(cut), 7):
            _check_answers_with_diagnostics(text[:i])


# A few through the real command, to check exit codes and that nothing escapes the CLI.
@settings(PROFILE, max_examples=6 * SCALE)
@given(mangled_specs())
def test_cli_check_exits_0_1_or_2(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("mangled") / "spec.par"
    path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    for fmt in ("text", "json"):
        done = subprocess.run(
            [sys.executable, "-m", "dslc.cli", "check", str(path), "--format", fmt],
            capture_output=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode in (0, 1, 2), done.stderr.decode(errors="replace")
        assert b"Traceback" not in done.stderr and b"internal error" not in done.stderr
