"""docs/language.md tells the truth: its examples check as it says, and it covers the language.

Fences in the document:
  ```par [mesh=AxB]    a complete spec: no diagnostic at all, already in `dslc fmt` form
  ```par-refused CODE  a complete spec the checker refuses with error CODE
  ```par-fragment      a piece: must parse as top-level items or as statements of a body
"""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import pytest

import dslc
from dslc.ir.nodes import DTYPE_BYTES, weights_by_path
from dslc.ir.settings import OPTIMIZERS, PRECISIONS
from dslc.layers import RULES
from dslc.schedules import KINDS
from dslc.syntax.format import format_module
from dslc.syntax.parser import _parser, parse
from dslc.syntax.source import from_text
from tests.conftest import ROOT

DOC_PATH = ROOT / "docs" / "language.md"
DOC = DOC_PATH.read_text(encoding="utf-8")

_FENCE = re.compile(r"^```(par[^\n]*)\n(.*?)^```", re.S | re.M)
FENCES = [(f"line {DOC[: m.start()].count(chr(10)) + 1}", m.group(1).split(), m.group(2)) for m in _FENCE.finditer(DOC)]


def _fences(kind: str) -> list[tuple[str, list[str], str]]:
    return [f for f in FENCES if f[1][0] == kind]


def _parses(text: str) -> bool:
    source, _ = from_text(text)
    return source is not None and parse(source)[0] is not None


def test_the_document_has_examples_of_every_kind() -> None:
    assert len(_fences("par")) >= 8 and _fences("par-refused") and _fences("par-fragment")
    assert {f[1][0] for f in FENCES} <= {"par", "par-refused", "par-fragment"}


@pytest.mark.parametrize(("where", "info", "text"), _fences("par"), ids=[f[0] for f in _fences("par")])
def test_complete_example_checks_clean(where: str, info: list[str], text: str) -> None:
    mesh = next((word.removeprefix("mesh=") for word in info[1:] if word.startswith("mesh=")), None)
    diags = dslc.check(text, mesh=mesh)
    assert not diags, "\n".join(f"{d.span.line}:{d.span.column} {d.code} {d.message}" for d in diags)
    source, _ = from_text(text)
    assert source is not None
    module, _ = parse(source)
    assert module is not None
    assert format_module(module, text) == text, "the example is not in `dslc fmt` form"


@pytest.mark.parametrize(("where", "info", "text"), _fences("par-refused"), ids=[f[0] for f in _fences("par-refused")])
def test_refused_example_is_refused_as_documented(where: str, info: list[str], text: str) -> None:
    [code] = info[1:]
    codes = [d.code for d in dslc.check(text) if d.is_error]
    assert code in codes, codes


@pytest.mark.parametrize(
    ("where", "info", "text"), _fences("par-fragment"), ids=[f[0] for f in _fences("par-fragment")]
)
def test_fragment_is_valid_syntax(where: str, info: list[str], text: str) -> None:
    assert _parses(text) or _parses(f"forward(x) {{\n{text}\n}}\n")


def test_documented_weight_paths_exist() -> None:
    [text] = [t for _, _, t in _fences("par") if t.startswith("model checkpointed")]
    analysis = dslc.analyze(text)
    assert analysis.program is not None
    paths = weights_by_path(analysis.program)
    section = DOC[DOC.index("## 9. Names") : DOC.index("## 10.")]
    for path in re.findall(r"`(towers\.[a-z0-9_.]+)`", section):
        assert path in paths, path


# ---- coverage: the document mentions everything the compiler knows ---------------------------------


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_layers", ROOT / "docs" / "gen_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", sorted(RULES))
def test_every_layer_kind_and_argument_is_documented(kind: str) -> None:
    start = DOC.index(f"#### `{kind}`")
    end = DOC.find("#### ", start + 1)
    section = DOC[start : end if end > 0 else DOC.index("<!-- END LAYERS -->")]
    rule = RULES[kind]
    for arg in rule.args:
        assert f"| `{arg.name}` |" in section, f"argument `{arg.name}` of `{kind}` is not documented"


def test_generated_layer_reference_is_up_to_date() -> None:
    assert _generator().updated(DOC) == DOC, "run .venv/bin/python docs/gen_layers.py"


def test_every_keyword_is_documented() -> None:
    words = {t.pattern.value for t in _parser().terminals if t.pattern.type == "str" and t.pattern.value.isalpha()}
    missing = sorted(w for w in words if f"`{w}`" not in DOC)
    assert not missing


@pytest.mark.parametrize(
    "name",
    [*KINDS, *DTYPE_BYTES, *PRECISIONS, *OPTIMIZERS, *sorted({h for hs in OPTIMIZERS.values() for h in hs})],
)
def test_every_setting_value_is_documented(name: str) -> None:
    assert f"`{name}`" in DOC
