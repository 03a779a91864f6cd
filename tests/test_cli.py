"""The `dslc` command: exit codes, output formats, the embedded default, internal errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslc import cli
from tests.conftest import SPECS

BROKEN = """model m
mesh data=2
input x: f32[6 @ data, 4]
forward(x) {
  fc: linear(5, 3)
}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_clean_spec_exits_0_and_summarises(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", str(SPECS / "tiny.par"))
    assert code == 0
    assert "ok" in out and "model tiny" in out and "mesh 2x2 (data, model)" in out
    assert err == ""


def test_check_counts_layers_and_the_blocks_they_form(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(SPECS / "tiny.par"))
    assert code == 0 and "model tiny, 16 layers (2 `decoder` blocks), 132,352 parameters" in out


def help_entries(text: str) -> dict[str, str]:
    """Each argument of an argparse help text (its invocation, as the help lists it) and its
    description ('' for none): an entry starts two spaces in, and its description follows
    the invocation on the line or on deeper-indented lines below it."""
    entries: dict[str, str] = {}
    invocation = None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            invocation, _, description = line.strip().partition("  ")
            entries[invocation] = description.strip()
        elif line.startswith("   ") and invocation is not None:
            entries[invocation] = (entries[invocation] + " " + line.strip()).strip()
        else:
            invocation = None
    return entries


def test_version_and_help_for_every_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"dslc {version('dslc')}\n"
    monkeypatch.setenv("COLUMNS", "200")
    _, top, _ = run(capsys, "--help")
    listed = top.split("positional arguments:\n", 1)[1].split("\n\n")[0]
    commands = [line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line.strip()]
    assert {"check", "compile", "train", "plan", "schedule"} <= set(commands)
    for name in commands:
        code, out, _ = run(capsys, name, "--help")
        assert code == 0, name
        undocumented = [flag for flag, description in help_entries(out).items() if not description]
        assert not undocumented, (name, undocumented)


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("99999999999x1", "mesh size 99,999,999,999 in '99999999999x1' is more than any machine has"),
        ("0x2", "mesh sizes must be positive, got '0x2'"),
    ],
)
def test_mesh_sizes_out_of_range_say_which(mesh: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "check", str(SPECS / "tiny.par"), "--mesh", mesh)
    assert code == 2 and err.startswith(f"dslc: error: {message}")


def test_a_folder_is_not_a_missing_file_and_dev_null_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "check", str(tmp_path))
    assert code == 2 and err == f"dslc: error: {tmp_path} is a folder, not a file\n"
    code, _, err = run(capsys, "check", os.devnull)
    assert code == 1 and "error[E028]: the spec is empty" in err


def test_check_without_spec_uses_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check")
    assert code == 0
    assert "tiny.par: ok" in out


def test_check_errors_exit_1_with_rendered_location(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "broken.par"
    spec.write_text(BROKEN)
    code, _, err = run(capsys, "check", str(spec))
    assert code == 1
    assert f"{spec}:5:7: error[E016]" in err
    assert "  5 |   fc: linear(5, 3)" in err or " 5 |   fc: linear(5, 3)" in err
    assert "1 error" in err


def test_check_json_lists_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "broken.par"
    spec.write_text(BROKEN)
    code, out, _ = run(capsys, "check", str(spec), "--format", "json")
    assert code == 1
    items = json.loads(out)
    assert [d["code"] for d in items] == ["E016"]
    for key in ("severity", "code", "message", "file", "line", "column", "end_line", "end_column", "notes", "help"):
        assert key in items[0]
    assert (items[0]["line"], items[0]["column"]) == (5, 7)


def test_check_json_of_clean_spec_is_empty_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "check", str(SPECS / "tiny.par"), "--format", "json")
    assert (code, json.loads(out)) == (0, [])


def test_mesh_override_changes_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "check", str(SPECS / "gpt_small.par"), "--mesh", "2x4x2")[0] == 0
    code, _, err = run(capsys, "check", str(SPECS / "gpt_small.par"), "--mesh", "2x3x2")
    assert code == 1 and "E014" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "does/not/exist.par"],
        ["check", "specs/tiny.par", "--mesh", "2xx2"],
        ["check", "specs/tiny.par", "--mesh", "0x2"],
        ["check", "specs/tiny.par", "--format", "yaml"],
        ["frobnicate"],
        [],
        ["schedule", "--kind", "1f1b", "--stages", "0", "--microbatches", "4"],
        ["schedule", "--kind", "zb-h9", "--stages", "2", "--microbatches", "4"],
        ["schedule", "--kind", "interleaved-1f1b", "--stages", "4", "--microbatches", "6", "--virtual", "2"],
        ["fmt", "does/not/exist.par"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.strip(), "a usage error must say what is wrong"
    assert "Traceback" not in err


def test_schedule_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schedule", "--kind", "1f1b", "--stages", "4", "--microbatches", "8", "--format", "json")
    assert code == 0
    table = json.loads(out)
    for key in ("kind", "stages", "microbatches", "virtual", "ticks", "bubble_fraction", "peak_in_flight", "actions"):
        assert key in table
    assert table["peak_in_flight"] == [4, 3, 2, 1]
    assert abs(table["bubble_fraction"] - 3 / 11) < 1e-12


def test_schedule_svg_is_an_svg_document(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schedule", "--kind", "gpipe", "--stages", "2", "--microbatches", "3", "--format", "svg")
    assert code == 0
    assert out.lstrip().startswith(("<svg", "<?xml")) and out.rstrip().endswith("</svg>")


def test_internal_error_is_reported_as_a_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "analyze", explode)
    monkeypatch.delenv("DSLC_TRACEBACK", raising=False)
    code, _, err = run(capsys, "check", str(SPECS / "tiny.par"))
    assert code == cli.EXIT_INTERNAL
    assert "internal error" in err and "boom" in err and "report" in err
    assert "Traceback" not in err


def test_console_script_runs_in_a_fresh_process(tmp_path: Path) -> None:
    spec = tmp_path / "broken.par"
    spec.write_text(BROKEN)
    proc = subprocess.run(
        [sys.executable, "-m", "dslc.cli", "check", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "error[E016]" in proc.stderr


# ---- schedules from files ---------------------------------------------------------------------


def saved_table(capsys: pytest.CaptureFixture[str], path: Path, kind: str, label: str | None = None) -> Path:
    """`dslc schedule --format json` for gpt_small's pipeline (2 stages, 4 microbatches), saved
    to `path`, its `kind` relabelled to `label` if given."""
    code, out, _ = run(capsys, "schedule", "--kind", kind, "--stages", "2", "--microbatches", "4", "--format", "json")
    assert code == 0
    table = json.loads(out)
    if label is not None:
        table["kind"] = label
    path.write_text(json.dumps(table, indent=2))
    return path


def planned_json(capsys: pytest.CaptureFixture[str], schedule: str | Path) -> dict[str, object]:
    code, out, err = run(capsys, "plan", str(SPECS / "gpt_small.par"), "--schedule", str(schedule), "--format", "json")
    assert code == 0, err
    plan = json.loads(out)
    assert isinstance(plan, dict)
    return plan


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "zb-v", "v-half"])
def test_a_saved_table_given_back_plans_as_its_kind(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same plan, every number of it; and relabelled as a user's own table, whose figures
    come from the table rather than the kind's closed forms, the same numbers still."""
    by_name = planned_json(capsys, kind)
    assert planned_json(capsys, saved_table(capsys, tmp_path / "saved.json", kind)) == by_name
    own = planned_json(capsys, saved_table(capsys, tmp_path / "own.json", kind, label="own"))
    # Only the label differs, where the plan names the schedule, and there is no closed form.
    expected = json.loads(json.dumps(by_name).replace(f"({kind}, ", "(own, "))
    expected["pipeline"] |= {"schedule": "own", "theoretical_bubble": None}
    assert own == expected


def test_a_table_checks_as_its_kind_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt_small = str(SPECS / "gpt_small.par")
    for kind in ("zb-h1", "zb-v"):
        saved = saved_table(capsys, tmp_path / f"{kind}.json", kind)
        assert run(capsys, "check", gpt_small, "--schedule", str(saved))[0] == 0


def test_a_corrupted_table_is_a_diagnostic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = saved_table(capsys, tmp_path / "t.json", "1f1b")
    table = json.loads(path.read_text())
    table["actions"][0].pop(0)  # stage 0's first forward: microbatch 0 never starts
    path.write_text(json.dumps(table))
    code, _, err = run(capsys, "plan", str(SPECS / "gpt_small.par"), "--schedule", str(path))
    assert code == 1
    assert "error[E030]" in err and "stage 1, tick 1: F of chunk 1, microbatch 0 needs the activation" in err
    assert "Traceback" not in err


AUTO = ("--mesh", "auto", "--devices", "4", "--device-memory", "1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["check", str(SPECS / "gpt_small.par"), "--schedule", "nowhere.json"],
            "--schedule nowhere.json: no such file",
        ),
        (["check", str(SPECS / "tiny.par"), "--schedule", "zb-v"], "the spec declares no pipeline"),
        (
            ["plan", str(SPECS / "gpt_small.par"), *AUTO, "--schedule", "t.json"],
            "a table fixes its stages and microbatches",
        ),
        (["schedule", "--kind", "zb-v", "--stages", "512", "--microbatches", "100000"], "more than the 262,144"),
    ],
)
def test_schedule_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_an_accelerator_jax_cannot_start_is_a_usage_error(tmp_path: Path) -> None:
    """JAX_PLATFORMS naming a platform whose jax plugin is not installed: what to install."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    args = [sys.executable, "-m", "dslc.cli", "init", str(SPECS / "tiny.par"), "-o", str(tmp_path / "w.npz")]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "internal error" not in done.stderr
    assert "jax cannot start the platform JAX_PLATFORMS='cuda'" in done.stderr
    assert "pip install -e '.[cuda]'" in done.stderr
    assert not (tmp_path / "w.npz").exists()
