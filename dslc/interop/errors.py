"""What goes wrong between a spec and a checkpoint, as diagnostics.

Codes (docs/checkpoints.md lists them with examples):

  C001  the checkpoint's config.json disagrees with the spec (a size, eps, the rope base, a
        tied head, biases): at the spec line that says otherwise, with the `--set` that fixes it
  C002  the spec's layers are not built like the checkpoint's family
  C003  the config asks for something dslc does not compute (rope scaling, an activation, ...)
  C004  config.json is missing, is not JSON, or holds a value of the wrong kind
  C005  the tensor files cannot be used: none, truncated, damaged, or not what the index says
  C006  a tensor is missing, unexpected, of the wrong shape or dtype, or stored transposed
  C007  weights to export do not fit the spec, a tied head is no longer its embedding, or the
        config.json they keep from their import is damaged
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from dslc.diagnostics import Diagnostic, Span, error


class CheckpointError(Exception):
    """A checkpoint or weights file that cannot be imported or exported; nothing was written.
    `diagnostics` say why, at the spec line or the file concerned."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        super().__init__("; ".join(d.message for d in self.diagnostics))


def file_span(path: Path) -> Span:
    """A whole file as a span: rendered as its name, without a line."""
    return Span(str(path), 0, 0, 0, 0)


def file_problem(
    path: Path, code: str, message: str, *, notes: Iterable[str] = (), help: str | None = None
) -> CheckpointError:
    return CheckpointError([error(code, message, file_span(path), notes=notes, help=help)])
