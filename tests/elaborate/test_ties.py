"""`tie` as the specs' own headers describe it: the line specs/llama.par's header gives for tied
checkpoints, put in place of its head, makes the head read the embedding's table."""

from __future__ import annotations

import re

import dslc
from dslc.plan.tensors import tensors
from tests.conftest import SPECS

LLAMA = SPECS / "llama.par"


def _head_kernel(text: str) -> str:
    """The stored array the head's kernel is: its own, or the one it is tied to."""
    analysis = dslc.analyze(text)
    assert analysis.ok and analysis.program is not None, [d.message for d in analysis.diagnostics]
    row = next(row for row in tensors(analysis.program).rows if row.path == "head")
    return next(w.stored for w in row.weights if w.name == "kernel")


def test_the_llama_headers_tied_head_reads_the_embedding() -> None:
    text = LLAMA.read_text(encoding="utf-8")
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    # The head line the header gives, in backquotes (a comment may wrap before it).
    (tied,) = re.findall(r"`(head: linear\([^`]*\) tie [^`]*)`", header.replace("\n# ", " "))
    (untied,) = [line.strip() for line in text.splitlines() if line.strip().startswith("head: ")]
    assert _head_kernel(text) == "head.kernel"  # as written: a weight of its own
    assert _head_kernel(text.replace(untied, tied)) == "embed.table"
