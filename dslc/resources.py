"""Where the files the compiler reads at run time live.

`grammar/` and `specs/` sit at the top of the repository (the design card names them there).
A source checkout or editable install finds them beside the package; a wheel carries copies
inside the package (see pyproject.toml's force-include).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"dslc is installed without its {name}/ folder")


def grammar_path() -> Path:
    return _find("grammar") / "par.lark"


def specs_dir() -> Path:
    return _find("specs")


DEFAULT_SPEC = "tiny.par"


def default_spec_path() -> Path:
    """The embedded spec the README's main command runs when given no file."""
    return specs_dir() / DEFAULT_SPEC
