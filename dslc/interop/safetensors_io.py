"""Tensors in and out: a checkpoint's `.safetensors` files, read one tensor at a time, and the
files dslc writes (a weights `.npz` streamed member by member, a `.safetensors` file).

Reading never holds more than the tensor at hand: each is copied out of its file (which
`safetensors` maps into memory) and the file is closed again, so the pages of tensors already
read are not kept resident. Every file's header is read first, before any tensor's bytes, so
a damaged, truncated or inconsistent checkpoint is refused before anything is written.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from numpy.lib import format as npy_format
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dslc.files import atomic_path
from dslc.interop.errors import file_problem

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# The safetensors dtypes a checkpoint's weights may have, as numpy dtypes.
FLOAT_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor is and what its header says."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...


class TensorFiles:
    """The tensors of a checkpoint folder, by name, from their headers alone."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tensors: dict[str, TensorInfo] = {}
        index = folder / INDEX
        weight_map = self._weight_map(index) if index.is_file() else None
        files = sorted({folder / name for name in weight_map.values()}) if weight_map is not None else self._files()
        for path in files:
            for name, info in _header(path).items():
                if name in self.tensors:
                    raise file_problem(
                        path, "C005", f"tensor `{name}` is also in {self.tensors[name].file.name}: which one is meant?"
                    )
                self.tensors[name] = info
        for name, file in (weight_map or {}).items():
            held = self.tensors.get(name)
            if held is None or held.file.name != file:
                where = f"it is in {held.file.name}" if held else "no file holds it"
                raise file_problem(index, "C005", f"says `{name}` is in {file}, but {where}")

    def _files(self) -> list[Path]:
        """The tensor files of a folder without an index: model.safetensors, or the only one."""
        if (self.folder / SINGLE).is_file():
            return [self.folder / SINGLE]
        found = sorted(self.folder.glob("*.safetensors"))
        pickled = sorted(p.name for p in self.folder.glob("*.bin")) + sorted(p.name for p in self.folder.glob("*.pt"))
        if len(found) > 1:
            raise file_problem(
                self.folder,
                "C005",
                f"{len(found)} .safetensors files and no {INDEX} to say which tensor is where",
            )
        if found:
            return found
        raise file_problem(
            self.folder,
            "C005",
            f"no {SINGLE} (or {INDEX} with the files it names)",
            notes=[f"found {', '.join(pickled)}: dslc reads only safetensors, never pickles"] if pickled else [],
            help="save the model with `save_pretrained(..., safe_serialization=True)`" if pickled else None,
        )

    def _weight_map(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise file_problem(index, "C005", f"cannot read it: {exc}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and Path(v).name == v for k, v in weight_map.items()
        ):
            raise file_problem(index, "C005", "no `weight_map` of tensor names to file names in this folder")
        missing = sorted({v for v in weight_map.values() if not (self.folder / v).is_file()})
        if missing:
            raise file_problem(index, "C005", f"names files that are not in the folder: {', '.join(missing)}")
        return weight_map

    def read(self, name: str) -> np.ndarray:
        """One tensor's values, copied out of its file (`get_tensor` copies: the array
        outlives the mapping)."""
        info = self.tensors[name]
        try:
            with safe_open(str(info.file), framework="numpy") as f:
                return np.asarray(f.get_tensor(name))
        except (SafetensorError, OSError) as exc:
            raise file_problem(info.file, "C005", f"cannot read `{name}`: {exc}") from None


def _header(path: Path) -> dict[str, TensorInfo]:
    try:
        with safe_open(str(path), framework="numpy") as f:
            out = {}
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                piece = f.get_slice(name)
                out[name] = TensorInfo(path, tuple(int(n) for n in piece.get_shape()), str(piece.get_dtype()))
            return out
    except (SafetensorError, OSError) as exc:
        raise file_problem(path, "C005", f"not a readable safetensors file: {exc}") from None


# ---- writing -----------------------------------------------------------------------------------


class NpzWriter:
    """Writes arrays into an .npz one at a time (the layout `np.savez` writes, which `np.load`
    reads), so a model never needs to be whole in memory to be saved."""

    def __init__(self, archive: zipfile.ZipFile) -> None:
        self._archive = archive
        self.names: list[str] = []

    def add(self, name: str, array: np.ndarray) -> None:
        with self._archive.open(name + ".npy", "w", force_zip64=True) as member:
            npy_format.write_array(member, np.asanyarray(array), allow_pickle=False)
        self.names.append(name)


@contextmanager
def npz_writer(path: Path, comment: bytes = b"") -> Iterator[NpzWriter]:
    """An NpzWriter whose archive replaces `path` when the block ends, and is deleted when it
    raises (nothing half-written is ever left at `path`). `comment` is the archive's comment
    (at most 65,535 bytes), which numpy does not read: see dslc/interop/remembered.py."""
    with atomic_path(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.comment = comment
        yield NpzWriter(archive)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """A .safetensors file as `transformers` saves one (metadata `format: pt`), atomically."""
    with atomic_path(path) as tmp:
        save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(tmp), metadata={"format": "pt"})
