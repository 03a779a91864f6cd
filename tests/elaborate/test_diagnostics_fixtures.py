"""Every diagnostic as a user meets it: a small spec beside what `dslc check` prints for it.

Each case is a pair in tests/elaborate/diagnostics/<family>/:

    <case>.par   a spec with one thing wrong (or a few, where the point is how they are told
                 apart), whose first comment says what it shows
    <case>.txt   exactly the text `dslc check <case>.par` prints for it (`render_text`):
                 each diagnostic's code, severity, line:column, message, the source lines
                 with the primary span (^^^) and its labels (---), the notes and the help

The case is checked from inside its folder under its bare file name, so the text holds no
path of this machine. The families follow docs/diagnostics.md: `parsing` (E001, E003),
`names` (E010, E011), `axes_and_splits` (E012-E015), `shapes` (E016), `shardings` (E017),
`pipelines` (E018-E022, E030, E031), `mesh` (E023), `arguments` (E024), `arithmetic`
(E025), `settings` (E026), `weight_sharding` (E027), `structure` (E028), `unsupported`
(E029), `ties` (E032, E033), `warnings` (W001-W005), and `every_mistake_once`: one run
reports every independent mistake, in source order, and none again as the mistakes it
causes further on.

A case that needs options gives them on its first line, as `dslc check` takes them:

    # check: --mesh 2x3 --set layers=4 --schedule 1f1b --backend gpu

`--mesh SIZES`, `--set NAME=VALUE` (repeatable), `--schedule KIND|FILE.json` and
`--backend cpu|gpu|tpu`. Anything else there, or such a line further down the file, fails
the case rather than being ignored.

`pytest --update-goldens` rewrites every .txt from the checker's current output, for review
as a diff. A case must print at least one diagnostic: a spec that checks clean, and what the
text does not show (where a span over several lines ends, the order of a diagnostic's
labels, JSON, unreadable files), are tested in tests/check/test_diagnostics.py.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

import dslc
from dslc.diagnostics import Diagnostic, render_text

FIXTURES = Path(__file__).resolve().parent / "diagnostics"
CASES = sorted(FIXTURES.glob("*/*.par"))
OPTIONS_LINE = "# check:"
# A diagnostic's first line in the rendering: `case.par:LINE:COLUMN: error[E014]: ...`.
HEADLINE = re.compile(r"^\S+\.par:\d+:\d+: (?:error|warning)\[(?P<code>[EW]0\d\d)\]: ", re.M)


@dataclass(frozen=True)
class Options:
    """What a case's `# check:` line gives `dslc check`."""

    mesh: str | None = None
    overrides: tuple[str, ...] = ()
    schedule: str | None = None
    backend: str | None = None


def options(text: str) -> Options:
    """The options a case's first line gives; ValueError for anything the line does not
    understand, so a misspelt option fails its case instead of checking it without."""
    first, *rest = text.split("\n")
    if any(line.startswith(OPTIONS_LINE) for line in rest):
        raise ValueError(f"`{OPTIONS_LINE}` gives options only on a case's first line")
    if not first.startswith(OPTIONS_LINE):
        return Options()
    words = iter(shlex.split(first.removeprefix(OPTIONS_LINE)))
    single: dict[str, str] = {}
    overrides: list[str] = []
    for flag in words:
        value = next(words, None)
        if flag not in ("--mesh", "--set", "--schedule", "--backend"):
            raise ValueError(f"unknown option {flag!r} in {first!r}: --mesh, --set, --schedule or --backend")
        if value is None or value.startswith("--"):
            raise ValueError(f"{flag} needs a value in {first!r}")
        if flag == "--set":
            overrides.append(value)
        elif flag in single:
            raise ValueError(f"{flag} is given twice in {first!r}")
        else:
            single[flag] = value
    if single.get("--backend", "cpu") not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"--backend is cpu, gpu or tpu, got {single['--backend']!r}")
    if not single and not overrides:
        raise ValueError(f"{first!r} gives no options")
    return Options(single.get("--mesh"), tuple(overrides), single.get("--schedule"), single.get("--backend"))


def checked(case: Path) -> tuple[list[Diagnostic], str]:
    """`dslc check <case>.par` with the case's options, from the case's folder: its
    diagnostics, and their text as the command prints it."""
    text = case.read_text(encoding="utf-8")
    given = options(text)
    with contextlib.chdir(case.parent):
        diags = dslc.check(
            case.name, mesh=given.mesh, overrides=list(given.overrides), schedule=given.schedule, backend=given.backend
        )
    return diags, render_text(diags, {case.name: text})


def case_id(case: Path) -> str:
    return f"{case.parent.name}/{case.stem}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_case_prints_its_golden(case: Path, update_goldens: bool) -> None:
    diags, printed = checked(case)
    assert diags, f"{case_id(case)} checks clean: a case shows a diagnostic"
    assert str(FIXTURES) not in printed
    golden = case.with_suffix(".txt")
    if update_goldens:
        golden.write_text(printed, encoding="utf-8")
    assert printed == golden.read_text(encoding="utf-8"), (
        f"{case_id(case)}: the checker now prints this; review, then rerun with --update-goldens"
    )


def test_every_case_has_its_golden_and_every_golden_its_case() -> None:
    assert len(CASES) >= 100, f"found only {len(CASES)} cases in {FIXTURES}"
    files = {p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file()}
    misplaced = {p for p in files if len(p.parts) != 2 or p.suffix not in (".par", ".txt")}
    assert not misplaced, "only <family>/<case>.par and .txt belong here"
    pars = {p.with_suffix("") for p in files if p.suffix == ".par"}
    txts = {p.with_suffix("") for p in files if p.suffix == ".txt"}
    assert pars - txts == set(), "cases without a golden (run with --update-goldens)"
    assert txts - pars == set(), "goldens without a case"


def test_every_golden_names_a_diagnostic_code() -> None:
    empty = [case_id(p) for p in sorted(FIXTURES.glob("*/*.txt")) if not HEADLINE.search(p.read_text("utf-8"))]
    assert not empty, "goldens that print no diagnostic"


def codes_in_goldens() -> set[str]:
    """Every code some case's golden prints."""
    return {m["code"] for p in FIXTURES.glob("*/*.txt") for m in HEADLINE.finditer(p.read_text(encoding="utf-8"))}


def test_the_options_line_is_read_as_dslc_check_takes_it() -> None:
    line = "# check: --mesh 2x3 --set a=1 --schedule zb-h1 --set 'b=true' --backend gpu\nmodel m\n"
    assert options(line) == Options("2x3", ("a=1", "b=true"), "zb-h1", "gpu")
    assert options("# --mesh 2x3 is not an options line\nmodel m\n") == Options()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("# check: --mseh 2x3\n", "unknown option '--mseh'"),
        ("# check: --mesh=2x3\n", "unknown option '--mesh=2x3'"),
        ("# check: --mesh\n", "--mesh needs a value"),
        ("# check: --mesh --backend gpu\n", "--mesh needs a value"),
        ("# check: --mesh 2x3 --mesh 4x1\n", "--mesh is given twice"),
        ("# check: --backend cuda\n", "--backend is cpu, gpu or tpu"),
        ("# check:\n", "gives no options"),
        ("# what this shows\n# check: --mesh 2x3\n", "only on a case's first line"),
    ],
)
def test_an_options_line_it_cannot_read_fails_the_case(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        options(text + "model m\n")
