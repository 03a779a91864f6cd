"""Byte-level text for language models: Python's own standard-library sources.

Every Python installation has them, so training needs no download. The corpus is the
top-level `*.py` modules of the stdlib folder (not its tests or site-packages), sorted by
name and joined with newlines: about 4.7 MB on CPython 3.11. It is fixed for one Python
version; its fingerprint is kept in checkpoints so a resume on another version is noticed.

Token ids are bytes (`tokens.NextTokens` makes the batches). A vocabulary V below 256 keeps
the bytes below V - 1 and maps every other byte to V - 1, one "unknown byte" id: with V = 128
(ASCII) that id is DEL, which Python sources never contain, and the few non-ASCII bytes (in
comments and strings) share it.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

from dslc.train.dataset import DataError


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
