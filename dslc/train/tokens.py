"""Token streams for language models: the user's files, memory-mapped, and byte-level text.

`dslc train --data PATH` reads

- a token file as nanoGPT and others write it: a flat array of token ids, `.bin` (raw
  uint16, or uint32 when the spec's vocabulary is above 65,536, which uint16 cannot hold)
  or `.npy` (any integer dtype, its header says which);
- a folder holding `train.bin` and `val.bin` (or `.npy`): nanoGPT's layout, the second the
  held-out split;
- any other file, or a folder of files, as byte-level text (files sorted by path, joined
  with a newline; hidden files and binary ones, with a NUL byte in their first 8 KiB as git
  judges, are skipped).

Files are memory-mapped and never read whole: a batch reads its windows, and each process of
a multi-process run reads only the rows of the batch its devices hold. Token files are read
through once when opened, a slice at a time, for an id outside the vocabulary. Without a
`val` file the last twentieth of the stream is held out for evaluation.

Why not Grain (the JAX ecosystem's data loader): its strengths are random access into record
files, worker processes and checkpointable iterators. Here a batch is a pure function of the
seed and the step (random windows of one flat stream), so the position to checkpoint is the
step itself, a window is one slice of a memory map, and per-process reading is choosing rows:
a page of numpy does it, and a dependency with its own file formats would add nothing.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dslc.ir import nodes as ir
from dslc.train.dataset import DataError

BYTES = 256
# The share of a stream kept out of training for evaluation, when no `val` file is given.
HELD_OUT = 0.05
# A .bin file holds uint16 ids unless the vocabulary needs more.
UINT16_IDS = 1 << 16
# Ids checked per slice of a token file: a multi-GB file is read once, a slice at a time,
# never whole (64 MiB of uint32).
CHECK_CHUNK = 1 << 24
_BINARY_PROBE = 8192


@dataclass(frozen=True)
class TokenStream:
    """Several 1-D integer arrays (memory maps, or bytes in memory) read as one stream."""

    parts: tuple[np.ndarray, ...] = field(repr=False)
    byte_level: bool  # ids are bytes: a vocabulary below 256 folds the high ones
    # Where each document but the first begins, as positions in the stream (sorted): a text
    # file of a folder is one document, a token file's end-of-document id ends one.
    boundaries: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens start .. start + length - 1, across parts where the window spans several."""
        pieces = []
        part = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[part])
            piece = self.parts[part][offset : offset + length]
            pieces.append(np.asarray(piece, dtype=np.int64))
            start, length, part = start + len(piece), length - len(piece), part + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def documents(self, start: int, length: int) -> np.ndarray:
        """Which document each of tokens start .. start + length - 1 belongs to, counted from
        the first of them (0)."""
        found = np.searchsorted(self.boundaries, np.arange(start, start + length), side="right")
        return (found - found[0]).astype(np.int64)

    def split(self, held_out: float) -> tuple[TokenStream, TokenStream]:
        """The stream up to its last `held_out` share, and that share."""
        cut = len(self) - int(len(self) * held_out)
        return self._slice(0, cut), self._slice(cut, len(self))

    def _slice(self, lo: int, hi: int) -> TokenStream:
        parts = []
        for part, begin in zip(self.parts, self.starts[:-1], strict=True):
            a, b = max(lo - int(begin), 0), min(hi - int(begin), len(part))
            if a < b:
                parts.append(part[a:b])
        inside = self.boundaries[(self.boundaries > lo) & (self.boundaries < hi)]
        return TokenStream(tuple(parts), self.byte_level, inside - lo)


def in_memory(data: bytes) -> TokenStream:
    return TokenStream((np.frombuffer(data, dtype=np.uint8),), byte_level=True)


@dataclass(frozen=True)
class TokenData:
    """What `--data PATH` names: the training stream, the held-out one, and how to describe them."""

    train: TokenStream
    held_out: TokenStream
    description: str
    fingerprint: str


def open_data(path: Path, vocab: int, document_end: int | None = None) -> TokenData:
    """Open `path` as the module docstring says; DataError for anything it cannot be. In a
    token file, the id `document_end` (when given) ends a document."""
    if not path.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if path.is_dir():
        pair = _split_files(path)
        if pair is not None:
            train, val = (_token_file(p, vocab, document_end) for p in pair)
            description = f"token files {pair[0]} ({len(train):,} tokens) and {pair[1].name} ({len(val):,}, held out)"
            return TokenData(train, val, description, fingerprint_files(pair))
        files = _text_files(path)
        if not files:
            raise DataError(f"--data {path}: the folder holds no text files (nor train.bin and val.bin)")
        stream = _text(files)
        what = f"text in {path}, byte-level ({len(files)} files, {len(stream) / 1e6:.1f} MB)"
    elif path.suffix in (".bin", ".npy"):
        stream = _token_file(path, vocab, document_end)
        what = f"token file {path} ({len(stream):,} tokens, {stream.parts[0].dtype})"
        files = [path]
    else:
        stream = _text([path])
        files = [path]
        what = f"text file {path}, byte-level ({len(stream) / 1e6:.1f} MB)"
    train, held_out = stream.split(HELD_OUT)
    return TokenData(train, held_out, f"{what}, the last {HELD_OUT:.0%} held out", fingerprint_files(files))


def _split_files(folder: Path) -> tuple[Path, Path] | None:
    for suffix in (".bin", ".npy"):
        train, val = folder / f"train{suffix}", folder / f"val{suffix}"
        if train.is_file():
            if not val.is_file():
                raise DataError(f"--data {folder}: it holds {train.name} but no {val.name} (the held-out split)")
            return train, val
    return None


def _token_file(path: Path, vocab: int, document_end: int | None = None) -> TokenStream:
    try:
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            dtype = np.uint16 if vocab <= UINT16_IDS else np.uint32
            if path.stat().st_size % np.dtype(dtype).itemsize:
                raise DataError(
                    f"--data {path}: {path.stat().st_size} bytes is not a whole number of {np.dtype(dtype).name} ids"
                )
            ids = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as exc:  # unreadable, or a .npy numpy cannot map
        raise DataError(f"--data {path}: cannot read it as a token file: {exc}") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        shape = "x".join(map(str, ids.shape))
        raise DataError(f"--data {path}: a token file is a flat array of integer ids, this one is {ids.dtype}[{shape}]")
    _check_ids(path, ids, vocab)
    ends = np.zeros(0, np.int64) if document_end is None else _documents_ended(ids, document_end)
    return TokenStream((ids,), byte_level=False, boundaries=ends)


def _documents_ended(ids: np.ndarray, end: int) -> np.ndarray:
    """Where a document begins after each `end` id of `ids` (the id belongs to the document it
    ends), read a slice at a time."""
    found = [
        np.flatnonzero(ids[start : start + CHECK_CHUNK] == end) + start + 1 for start in range(0, len(ids), CHECK_CHUNK)
    ]
    ends = np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)
    return ends[ends < len(ids)]


def _check_ids(path: Path, ids: np.ndarray, vocab: int) -> None:
    """DataError naming the first id of `ids` outside 0 .. vocab - 1.

    The whole file is checked before training: a batch meets a bad id only when it samples
    it, which may be hours into a run (and never in a short one). One vectorised pass, a
    slice of the memory map at a time, so a file larger than memory is never held whole."""
    limits = np.iinfo(ids.dtype)
    too_high = limits.max >= vocab  # never for uint16 ids and a vocabulary of 65,536 or more
    negative = limits.min < 0
    if not (too_high or negative):
        return
    for start in range(0, len(ids), CHECK_CHUNK):
        chunk = ids[start : start + CHECK_CHUNK]
        # A reduction per slice finds whether it holds a bad id; only such a slice (the
        # last one read) is searched for the first.
        if (too_high and chunk.max() >= vocab) or (negative and chunk.min() < 0):
            first = int(np.argmax((chunk < 0) | (chunk >= vocab)))
            raise DataError(
                f"--data {path}: token id {int(chunk[first])} at position {start + first:,} is outside the spec's "
                f"vocabulary of {vocab} (ids 0 .. {vocab - 1})"
            )


def _text_files(folder: Path) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            if not name.startswith(".") and path.is_file() and not _is_binary(path):
                found.append(path)
    return found


def _is_binary(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(_BINARY_PROBE)
    except OSError:
        return True


def _text(files: Sequence[Path]) -> TokenStream:
    """The files as one byte stream, each a document: the newline that joins two ends the first."""
    parts: list[np.ndarray] = []
    boundaries: list[int] = []
    at = 0
    newline = np.frombuffer(b"\n", dtype=np.uint8)
    for path in files:
        try:
            size = path.stat().st_size
            part = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except (OSError, ValueError) as exc:
            raise DataError(f"--data {path}: cannot read it: {exc}") from None
        if parts:
            parts.append(newline)
            at += 1
            boundaries.append(at)
        parts.append(part)
        at += len(part)
    return TokenStream(tuple(parts), byte_level=True, boundaries=np.asarray(boundaries, np.int64))


def fingerprint_files(files: Sequence[Path]) -> str:
    """A short hash of the files' names, sizes, and first and last MiB: reading a large file
    whole to notice a change would cost what training saves by mapping it."""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class NextTokens:
    """Batches of windows of `seq + 1` tokens at random offsets of a stream: a window's first
    `seq` tokens are the inputs, its last `seq` the targets (each the next token).

    A batch depends only on the seed and the step, so resuming at step k reads exactly what an
    uninterrupted run would have; `rows` picks the rows this process holds, the others are
    left zero and never read."""

    stream: TokenStream
    vocab: int
    tokens: ir.Input
    targets: ir.Input
    description: str
    fingerprint: str
    held_out: NextTokens | None = None  # windows of the held-out stream, for evaluation
    # Packed documents: the input of document ids attention reads (`segments=`), and the
    # loss's mask, 0 where a target is the next document's first token.
    segments: ir.Input | None = None
    counted: ir.Input | None = None

    @property
    def unit(self) -> str:
        return "tokens"

    @property
    def per_batch(self) -> int:
        return self.tokens.type.numel

    def batch(self, seed: int, step: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        count, seq = self.tokens.type.shape
        if len(self.stream) <= seq:
            raise DataError(f"{self.description}: {len(self.stream):,} tokens cannot fill a window of {seq + 1}")
        # Seeded by (seed, step) alone: batch k is the same whether or not the run was resumed.
        rng = np.random.default_rng((seed, step))
        starts = rng.integers(0, len(self.stream) - seq, size=count)
        windows = np.zeros((count, seq + 1), dtype=np.int64)
        for row in range(count) if rows is None else rows:
            windows[row] = self.stream.window(int(starts[row]), seq + 1)
        if self.stream.byte_level and self.vocab < BYTES:
            windows = np.minimum(windows, self.vocab - 1)
        elif windows.max(initial=0) >= self.vocab:
            row, col = np.unravel_index(int(np.argmax(windows >= self.vocab)), windows.shape)
            raise DataError(
                f"{self.description}: token id {windows[row, col]} at position {int(starts[row]) + int(col):,} "
                f"(step {step}) is not below the spec's vocabulary of {self.vocab}"
            )
        windows = windows.astype(np.int32)
        batch = {self.tokens.name: windows[:, :-1], self.targets.name: windows[:, 1:]}
        if self.segments is None and self.counted is None:
            return batch
        # A window packs the documents it crosses: each token keeps to its own (attention by
        # `segments`), and a position whose target begins the next document is not counted.
        documents = np.zeros((count, seq + 1), dtype=np.int64)
        for row in range(count) if rows is None else rows:
            documents[row] = self.stream.documents(int(starts[row]), seq + 1)
        if self.segments is not None:
            batch[self.segments.name] = documents[:, :-1].astype(np.int32)
        if self.counted is not None:
            dtype = np.dtype(ir.DTYPES[self.counted.type.dtype].jax)
            batch[self.counted.name] = (documents[:, 1:] == documents[:, :-1]).astype(dtype)
        return batch
