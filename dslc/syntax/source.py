"""Reading a spec: bytes to text, with diagnostics instead of exceptions for bad files."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from dslc.diagnostics import Diagnostic, Span, error

# Specs are hand-written; anything this large is a mistake (or an attack on the checker).
MAX_SOURCE_BYTES = 4 * 1024 * 1024
# Brackets nested deeper than this are refused before parsing, so no pass can run out of
# Python stack on them.
MAX_NESTING = 64


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    text: str


def read_path(path: str | os.PathLike[str]) -> tuple[Source | None, list[Diagnostic]]:
    name = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
    except OSError as exc:
        span = Span(name, 1, 1, 1, 1)
        guess = _nearby_spec(Path(path)) if isinstance(exc, FileNotFoundError) else None
        hint = f"did you mean `{guess}`?" if guess else None
        return None, [error("E002", f"cannot read `{name}`: {exc.strerror or exc}", span, help=hint)]
    return decode(name, data)


def _nearby_spec(path: Path) -> Path | None:
    """The spec in the same folder whose name is closest to a missing one's."""
    try:
        names = [p.name for p in path.parent.glob("*.par")]
    except OSError:
        return None
    found = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return path.parent / found[0] if found else None


def decode(name: str, data: bytes) -> tuple[Source | None, list[Diagnostic]]:
    if len(data) > MAX_SOURCE_BYTES:
        span = Span(name, 1, 1, 1, 1)
        msg = f"file is larger than {MAX_SOURCE_BYTES // (1024 * 1024)} MiB"
        return None, [error("E003", msg, span, help="a .par spec is a short text file")]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        span = Span(name, line, column, line, column + 1)
        msg = f"file is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        return None, [error("E002", msg, span, help="a .par spec is a UTF-8 text file")]
    return Source(name, text.removeprefix("\ufeff")), []


def from_text(text: str, name: str = "<string>") -> tuple[Source | None, list[Diagnostic]]:
    return decode(name, text.encode("utf-8", errors="surrogatepass"))


def resolve(source_or_path: str | os.PathLike[str]) -> tuple[Source | None, list[Diagnostic]]:
    """A Path is a file; so is a str of one line that names an existing file or folder, or
    ends in `.par` (a missing spec is reported as one, not parsed as text); any other str
    is the spec's text."""
    if isinstance(source_or_path, os.PathLike):
        return read_path(source_or_path)
    text = source_or_path
    one_line = "\n" not in text and len(text) < 4096
    if one_line and (text.strip().endswith(".par") or _exists(text)):
        return read_path(text.strip())
    return from_text(text)


def _exists(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a name too long for the OS, or one with a NUL in it
        return False


def check_nesting(source: Source) -> list[Diagnostic]:
    """Refuse absurdly deep bracket nesting before the parser builds a tree of it."""
    depth = 0
    line, column = 1, 1
    in_comment = False
    for ch in source.text:
        if ch == "\n":
            line, column, in_comment = line + 1, 1, False
            continue
        if not in_comment:
            if ch == "#":
                in_comment = True
            elif ch in "([{":
                depth += 1
                if depth > MAX_NESTING:
                    span = Span(source.name, line, column, line, column + 1)
                    msg = f"brackets nested more than {MAX_NESTING} deep"
                    return [error("E003", msg, span, help="flatten the expression or block")]
            elif ch in ")]}":
                depth = max(0, depth - 1)
        column += 1
    return []
