"""Byte-level text for language models: Python's own standard-library sources.

Every Python installation has them, so training needs no download. The corpus is the
top-level `*.py` modules of the stdlib folder (not its tests or site-packages), sorted by
name and joined with newlines: about 4.7 MB on CPython 3.11. It is fixed for one Python
version; its fingerprint is kept in checkpoints so a resume on another version is noticed.

Token ids are bytes. A vocabulary V below 256 keeps the bytes below V - 1 and maps every
other byte to V - 1, one "unknown byte" id: with V = 128 (ASCII) that id is DEL, which
Python sources never contain, and the few non-ASCII bytes (in comments and strings) share it.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dslc.ir import nodes as ir
from dslc.train.dataset import DataError

BYTES = 256


@functools.cache
def stdlib_corpus() -> bytes:
    """The standard library's top-level modules, sorted by file name, as one byte string."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DataError(
            f"found no Python sources in the standard-library folder {root} (a zipped stdlib?): "
            "the embedded byte-level corpus is built from them"
        )
    return b"\n".join(p.read_bytes() for p in files)


@dataclass(frozen=True)
class ByteCorpus:
    """Windows of `seq + 1` bytes at random offsets; a window's first `seq` bytes are the
    tokens and its last `seq` the targets (the next byte of each token)."""

    text: bytes = field(repr=False)
    vocab: int
    tokens: ir.Input
    targets: ir.Input

    @property
    def description(self) -> str:
        return f"Python standard-library sources, byte-level ({len(self.text) / 1e6:.1f} MB, vocab {self.vocab})"

    @property
    def unit(self) -> str:
        return "tokens"

    @property
    def per_batch(self) -> int:
        return self.tokens.type.numel

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.text).hexdigest()[:16]

    @functools.cached_property
    def _ids(self) -> np.ndarray:
        ids = np.frombuffer(self.text, dtype=np.uint8).astype(np.int32)
        return np.minimum(ids, self.vocab - 1) if self.vocab < BYTES else ids

    def batch(self, seed: int, step: int) -> dict[str, np.ndarray]:
        rows, seq = self.tokens.type.shape
        # Seeded by (seed, step) alone: batch k is the same whether or not the run was resumed.
        rng = np.random.default_rng((seed, step))
        starts = rng.integers(0, len(self._ids) - seq, size=rows)
        windows = self._ids[starts[:, None] + np.arange(seq + 1)]
        return {self.tokens.name: windows[:, :-1], self.targets.name: windows[:, 1:]}
