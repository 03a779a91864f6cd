"""Diagnostics: the data every pass reports, and how it is shown to a person or a tool.

A diagnostic is plain data (severity, code, message, primary span, secondary labels, notes,
help). Passes collect them and keep going; nothing here raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypedDict, Unpack


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source file: 1-based line and column, end column exclusive."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def to(self, other: Span) -> Span:
        """The span from the start of this one to the end of `other`."""
        return Span(self.file, self.line, self.column, other.end_line, other.end_column)


NO_SPAN = Span("<none>", 0, 0, 0, 0)


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Label:
    """A secondary location that explains the other half of a conflict."""

    span: Span
    message: str


@dataclass(frozen=True, slots=True)
class Diagnostic:
    severity: Severity
    code: str
    message: str
    span: Span
    labels: tuple[Label, ...] = ()
    notes: tuple[str, ...] = ()
    help: str | None = None

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_dict(self) -> dict[str, object]:
        return {
            "severity": str(self.severity),
            "code": self.code,
            "message": self.message,
            "file": self.span.file,
            "line": self.span.line,
            "column": self.span.column,
            "end_line": self.span.end_line,
            "end_column": self.span.end_column,
            "labels": [
                {
                    "message": label.message,
                    "line": label.span.line,
                    "column": label.span.column,
                    "end_line": label.span.end_line,
                    "end_column": label.span.end_column,
                }
                for label in self.labels
            ],
            "notes": list(self.notes),
            "help": self.help,
        }


def error(
    code: str,
    message: str,
    span: Span,
    *,
    labels: Iterable[Label] = (),
    notes: Iterable[str] = (),
    help: str | None = None,
) -> Diagnostic:
    return Diagnostic(Severity.ERROR, code, message, span, tuple(labels), tuple(notes), help)


def warning(
    code: str,
    message: str,
    span: Span,
    *,
    labels: Iterable[Label] = (),
    notes: Iterable[str] = (),
    help: str | None = None,
) -> Diagnostic:
    return Diagnostic(Severity.WARNING, code, message, span, tuple(labels), tuple(notes), help)


def has_errors(diagnostics: Iterable[Diagnostic]) -> bool:
    return any(d.is_error for d in diagnostics)


def sort_key(d: Diagnostic) -> tuple[str, int, int, str]:
    return (d.span.file, d.span.line, d.span.column, d.code)


# ---- rendering ------------------------------------------------------------------------------


def render_text(diagnostics: Sequence[Diagnostic], sources: dict[str, str]) -> str:
    """rustc-style text: header, location, the source line with carets, notes and help."""
    return "".join(_render_one(d, sources) for d in diagnostics)


def _printable(line: str) -> str:
    """A source line as a terminal can show it: lines are counted by newlines alone (as the
    parser counts them), and any other control or line-separator character is shown as one
    replacement character, so that the carets under it still line up."""
    line = line.removesuffix("\r")
    return "".join("\ufffd" if (c < " " and c != "\t") or c in "\x7f\x85\u2028\u2029" else c for c in line)


def _render_one(d: Diagnostic, sources: dict[str, str]) -> str:
    s = d.span
    # A span without a line is a whole file (a checkpoint's): its name alone says where.
    where = f"{s.file}:{s.line}:{s.column}" if s.line else s.file
    out = [f"{where}: {d.severity}[{d.code}]: {d.message}\n"]
    lines = [_printable(line) for line in sources.get(s.file, "").split("\n")]
    gutter = len(str(max([s.line] + [label.span.line for label in d.labels]))) + 1
    excerpts = [(s, "", "^")] + [(label.span, label.message, "-") for label in d.labels]
    shown_line = 0
    for span, text, mark in sorted(excerpts, key=lambda e: (e[0].line, e[0].column)):
        if not 1 <= span.line <= len(lines):
            continue
        source_line = lines[span.line - 1].expandtabs(1)
        end = span.end_column if span.end_line == span.line else len(source_line) + 1
        width = max(1, end - span.column)
        # Two marks on one line (a label and the primary span, say) share one copy of it.
        if span.line != shown_line:
            out.append(f"{str(span.line).rjust(gutter)} | {source_line}\n")
            shown_line = span.line
        carets = " " * (span.column - 1) + mark * width
        out.append(f"{' ' * gutter} | {carets}{' ' + text if text else ''}\n")
    for note in d.notes:
        out.append(f"{' ' * gutter} = note: {note}\n")
    if d.help:
        out.append(f"{' ' * gutter} = help: {d.help}\n")
    return "".join(out)


def render_json(diagnostics: Sequence[Diagnostic]) -> str:
    return json.dumps([d.to_dict() for d in diagnostics], indent=2) + "\n"


class Extras(TypedDict, total=False):
    """What a diagnostic may add to its message: `error`'s and `warning`'s keywords."""

    labels: Iterable[Label]
    notes: Iterable[str]
    help: str | None


@dataclass
class Diagnostics:
    """A pass's collector: append as you go, read once at the end."""

    items: list[Diagnostic] = field(default_factory=list)

    def add(self, d: Diagnostic) -> None:
        self.items.append(d)

    def error(self, code: str, message: str, span: Span, **kw: Unpack[Extras]) -> None:
        self.items.append(error(code, message, span, **kw))

    def warning(self, code: str, message: str, span: Span, **kw: Unpack[Extras]) -> None:
        self.items.append(warning(code, message, span, **kw))

    @property
    def has_errors(self) -> bool:
        return has_errors(self.items)
