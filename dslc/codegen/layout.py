"""The generated module laid out as `ruff format` lays out Python, its imports sorted as ruff's
isort sorts them: the tools a user's own code passes through, rather than rules of our own.
The templates write each statement on one line; the formatter breaks what is too long."""

from __future__ import annotations

import functools
import subprocess
import sys

LINE_LENGTH = 120
# The settings are the module's own, whatever configuration the directory holds.
_SETTINGS = (
    "--isolated",
    "--line-length",
    str(LINE_LENGTH),
    "--target-version",
    "py311",
    "--stdin-filename",
    "module.py",
)
# The runtime library sits beside the module, a third party to it wherever it is written.
_ISORT = ("--config", "lint.isort.known-third-party = ['dslc_runtime']")


@functools.lru_cache(maxsize=64)
def laid_out(text: str) -> str:
    """`text` (a module's Python) with its imports sorted and merged, then formatted."""
    text = _ruff(("check", "--select", "I", "--fix", "--exit-zero", "--quiet", *_ISORT), text)
    return _ruff(("format",), text)


def _ruff(command: tuple[str, ...], text: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *_SETTINGS, "-"], input=text, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"`ruff {command[0]}` failed on a generated module; this is a bug in dslc, please report it: "
            + (done.stderr.strip() or f"exit status {done.returncode}")
        )
    return done.stdout
