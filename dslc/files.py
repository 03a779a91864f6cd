"""The user's files: written whole or not at all, and arrays read without unpickling."""

from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# How every zip archive (and so every .npz) starts: a local file header, or for an archive
# with no members the end-of-directory record.
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


class FolderMissing(FileNotFoundError):
    """The folder a file was to be written into does not exist."""


class UnreadableArrays(ValueError):
    """A file that is not an .npz archive of plain numeric arrays."""


def read_npz(path: Path) -> dict[str, Any]:
    """Every array of an .npz archive (as `numpy.savez` writes it), read whole.

    Never unpickles: an archive holding Python objects is refused, as is anything that is
    not a zip of `.npy` arrays (numpy would try to unpickle it, or suggest doing so).
    """
    import numpy as np

    try:
        with path.open("rb") as f:  # opened here, so that it is closed whatever np.load raises
            if f.read(4) in _ZIP_MAGIC:
                f.seek(0)
                with np.load(f, allow_pickle=False) as archive:
                    return {name: archive[name] for name in archive.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise UnreadableArrays(f"{path} holds arrays of Python objects, which are never unpickled") from None
        raise UnreadableArrays(f"cannot read {path}: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise UnreadableArrays(f"cannot read {path}: {reason} (a damaged or truncated archive?)") from None
    if path.suffix == ".safetensors":
        raise UnreadableArrays(
            f"{path} is one file of a Hugging Face checkpoint, not an .npz archive: give the folder that holds it "
            f"({path.parent}), with its config.json"
        )
    raise UnreadableArrays(f"{path} is not an .npz archive (a zip of .npy arrays, as numpy.savez writes)")


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
