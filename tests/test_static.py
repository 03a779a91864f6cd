"""The package's own code stays lint-clean, formatted and type-checked (docs: STYLE.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_and_format_are_clean() -> None:
    for argv in (("ruff", "check", "dslc", "tests", "bench"), ("ruff", "format", "--check", "dslc", "tests", "bench")):
        done = run(*argv)
        assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean_on_the_package() -> None:
    done = run("mypy", "dslc")
    assert done.returncode == 0, done.stdout + done.stderr
