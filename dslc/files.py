"""Writing the user's files: whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class FolderMissing(FileNotFoundError):
    """The folder a file was to be written into does not exist."""


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace (or create) a file in one step, so a crash never leaves it half-written."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        f.write(data)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary file beside `path` for the block to write (by name, so that a library that
    writes files can write it); when the block ends, it replaces `path` in one step. When the
    block raises, it is deleted and `path` is left as it was.

    A replaced file keeps its permissions; a new one gets the usual ones (0666 less the
    umask), not the owner-only mode of the temporary file it is written through.
    """
    if not path.parent.is_dir():
        raise FolderMissing(f"no such folder: {path.parent}")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
