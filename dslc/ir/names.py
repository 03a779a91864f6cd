"""Unknown names, with a did-you-mean."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from dslc.diagnostics import Diagnostic, Span, error


def closest(name: str, candidates: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_name(
    what: str,
    name: str,
    span: Span,
    candidates: Iterable[str],
    code: str = "E010",
    message: str | None = None,
) -> Diagnostic:
    """`unknown {what} `{name}``, or `message` where that phrasing reads badly, with the
    closest candidate as a did-you-mean, or all of them when there are few and none is close."""
    candidates = tuple(candidates)
    guess = closest(name, candidates)
    notes = []
    if not guess and 0 < len(candidates) <= 12:
        notes.append("known: " + ", ".join(f"`{c}`" for c in sorted(set(candidates))))
    return error(
        code,
        message or f"unknown {what} `{name}`",
        span,
        notes=notes,
        help=f"did you mean `{guess}`?" if guess else None,
    )
