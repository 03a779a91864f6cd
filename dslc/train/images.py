"""Image classifiers' own data: `dslc train --data PATH` for a spec that takes images and labels.

PATH is one of

- an `.npz` file holding two arrays, `images` and `labels` (`np.savez(PATH, images=...,
  labels=...)`);
- a folder holding the same two arrays as `images.npy` and `labels.npy`: memory-mapped, and
  read a batch at a time when the images are already uint8 at the spec's size and channels;
- a folder with a sub-folder of image files per class (`cat/*.png`, `dog/*.jpg`, searched
  recursively; the ImageFolder layout of torchvision and Keras): the classes, sorted by
  name, are labels 0, 1, ...; hidden files and files without an image extension are skipped
  (and counted in the log).

`images` is [N, H, W, C] (channels last) or [N, H, W] (one channel), of uint8 or another
integer dtype holding 0..255, or of floats in 0..1; `labels` is [N] integer class ids below
the spec's class count. Pixels reach the spec scaled to [0, 1], as the embedded digits do.

Each image is fitted to the spec's input: converted to its channel count (gray repeated into
every channel; RGB to gray as Pillow does it, ITU-R 601-2 luma; RGBA's alpha dropped), then,
when its size differs, cropped about its centre to the spec's aspect ratio and resized with
Pillow's bilinear filter (antialiased when shrinking). Resizing rather than refusing: photos
in a class folder come in every size, so refusing all but one size would refuse nearly every
folder. Cropping rather than stretching: a stretched image shows its objects out of shape.
A spec whose input is [batch, side*side] takes one-channel side x side images, flattened.

A fixed share (`HELD_OUT`) of the images, the same draw for every run, is kept out of
training for `--eval-every`, as the digits' are. Everything is checked before training (every
label against the spec's classes, every file decoded): a run never stops hours in on a bad
example. Nothing here imports jax.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dslc.ir import nodes as ir
from dslc.train.dataset import DataError
from dslc.train.digits import epoch_order
from dslc.train.tokens import fingerprint_files

# The share of the images kept out of training for evaluation.
HELD_OUT = 0.1
# What the ImageFolder layout reads, by extension (case ignored): torchvision's list, and GIF.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# Pillow's modes for 1, 3 and 4 channels.
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
# Pixels deeper than 8 bits: Pillow's conversion to 8 bits clips them rather than scaling,
# so such images are refused instead of read wrong.
_DEEP_MODES = ("I", "F", "I;16", "I;16L", "I;16B", "I;16N")
# Pillow's RGB to gray, in 16-bit fixed point (ITU-R 601-2: 0.299 R + 0.587 G + 0.114 B),
# so arrays and image files of the same pixels give the same gray levels.
_LUMA = np.array([19595, 38470, 7471], dtype=np.uint32)
# Integer pixels are checked for 0..255 a slice at a time, never converted whole first.
_CHUNK = 4096
_FORMATS = (
    "image data are an .npz file holding `images` and `labels`, a folder holding images.npy and labels.npy, "
    "or a folder with a sub-folder of images per class"
)


@dataclass(frozen=True)
class ImageShape:
    """What one image of the spec's input is: height x width x channels, and whether the
    input takes it flattened ([batch, side*side], one channel)."""

    height: int
    width: int
    channels: int
    flat: bool = False

    def describe(self) -> str:
        return f"{self.height}x{self.width}x{self.channels}"


@dataclass(frozen=True)
class Images:
    """An image set fitted to a spec: `pixels` [N, H, W, C] (uint8 0..255, or float32 in
    0..1; possibly a read-only memory map), `labels` [N], and which of them are held out."""

    pixels: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)
    held_out: np.ndarray = field(repr=False)  # indices into pixels, sorted
    train: np.ndarray = field(repr=False)
    description: str
    held_out_description: str
    fingerprint: str
    notes: tuple[str, ...] = ()  # lines for the log: the class folders' labels, files skipped


def open_images(path: Path, shape: ImageShape, classes: int, model: str) -> Images:
    """Open `path` as the module docstring says, fitted to `shape`, its labels checked
    against `classes`; DataError for anything it cannot be (`model` names the spec)."""
    if not path.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if path.is_dir():
        if (path / "images.npy").is_file() or (path / "labels.npy").is_file():
            return _npy_pair(path, shape, classes)
        return _image_folder(path, shape, classes, model)
    if path.suffix.lower() == ".npz":
        return _npz(path, shape, classes)
    if path.suffix.lower() == ".npy":
        raise DataError(
            f"--data {path}: a .npy file alone holds no labels; put `images.npy` and `labels.npy` in a folder and "
            "give the folder"
        )
    kind = "an image file" if path.suffix.lower() in IMAGE_EXTENSIONS else "a text or token file"
    raise DataError(f"--data {path}: spec `{model}` classifies images and this is {kind}; {_FORMATS}")


def looks_like_images(path: Path) -> str | None:
    """What makes `path` an image set rather than tokens or text (None when nothing does):
    a language model given one is refused, where reading it as bytes would train on noise."""
    if path.is_file():
        if path.suffix.lower() == ".npz":
            return "an .npz file (image data)"
        return "an image file" if path.suffix.lower() in IMAGE_EXTENSIONS else None
    if not path.is_dir():
        return None
    if (path / "images.npy").is_file():
        return "a folder holding images.npy (image data)"
    files = [name for _, _, names in _walk(path) for name in names]
    if files and all(_is_image_name(name) for name in files):
        return "a folder of image files"
    return None


# --- arrays ------------------------------------------------------------------------------------


def _npz(path: Path, shape: ImageShape, classes: int) -> Images:
    try:
        with np.load(path, allow_pickle=False) as found:
            names = list(found.keys())
            if "images" not in names or "labels" not in names:
                held = ", ".join(f"`{n}`" for n in names) or "nothing"
                raise DataError(
                    f"--data {path}: an .npz of images holds arrays named `images` and `labels`; this one holds {held}"
                )
            images, labels = found["images"], found["labels"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # not an .npz, or damaged
        raise DataError(f"--data {path}: cannot read it as an .npz file: {exc}") from None
    return _from_arrays(path, images, labels, shape, classes, f"images in {path}", fingerprint_files([path]))


def _npy_pair(folder: Path, shape: ImageShape, classes: int) -> Images:
    files = [folder / "images.npy", folder / "labels.npy"]
    for file in files:
        if not file.is_file():
            other = files[0] if file == files[1] else files[1]
            raise DataError(f"--data {folder}: it holds {other.name} but no {file.name}")
    try:
        # Memory-mapped read-only: a set larger than memory is read a batch at a time, and
        # the user's files are never written.
        images = np.load(files[0], mmap_mode="r", allow_pickle=False)
        labels = np.load(files[1], allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f"--data {folder}: cannot read images.npy and labels.npy: {exc}") from None
    source = f"images in {folder} (images.npy, labels.npy)"
    return _from_arrays(folder, images, labels, shape, classes, source, fingerprint_files(files))


def _from_arrays(
    path: Path,
    images: np.ndarray,
    labels: np.ndarray,
    shape: ImageShape,
    classes: int,
    source: str,
    fingerprint: str,
) -> Images:
    dims = "x".join(map(str, images.shape))
    if images.ndim not in (3, 4):
        raise DataError(
            f"--data {path}: `images` is {images.dtype}[{dims}]; images are [N, height, width, channels] "
            "(or [N, height, width] for one channel)"
        )
    integer, real = np.issubdtype(images.dtype, np.integer), np.issubdtype(images.dtype, np.floating)
    if not (integer or real):
        raise DataError(
            f"--data {path}: `images` is {images.dtype}[{dims}]; pixels are integers 0..255 (uint8) or floats in 0..1"
        )
    if len(images) == 0:
        raise DataError(f"--data {path}: it holds no images")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        hint = " (labels.reshape(-1) makes them [N])" if labels.ndim == 2 and labels.shape[1] == 1 else ""
        raise DataError(
            f"--data {path}: `labels` is {labels.dtype}[{'x'.join(map(str, labels.shape))}]; labels are [N] integer "
            f"class ids{hint}"
        )
    if len(labels) != len(images):
        raise DataError(f"--data {path}: {len(labels):,} labels for {len(images):,} images; each image needs one")
    _check_labels(path, labels, classes)
    pixels = _range_checked(path, images if images.ndim == 4 else images[..., None], integer)
    pixels = _channels(path, pixels, shape)
    height, width = pixels.shape[1:3]
    fitted = f"as {shape.describe()}"
    if (height, width) != (shape.height, shape.width):
        pixels = np.stack([_fit(image, shape) for image in pixels])
        fitted = f"resized from {height}x{width} to {shape.describe()}"
    kinds = len(np.unique(labels))
    what = f"{len(pixels):,} {fitted}, {kinds} class{'es' if kinds > 1 else ''}"
    return _split(path, pixels, labels.astype(np.int64), source, what, fingerprint)


def _channels(path: Path, pixels: np.ndarray, shape: ImageShape) -> np.ndarray:
    """`pixels` [N, H, W, c] with the spec's channels: gray repeated, RGB(A) to gray, RGBA's
    alpha dropped; any other change of channel count refused."""
    have, want = pixels.shape[3], shape.channels
    if have == want:
        return pixels
    if have == 1:
        return np.repeat(pixels, want, axis=3)
    if have in (3, 4) and want == 1:
        rgb = pixels[..., :3]
        if pixels.dtype == np.uint8:  # Pillow's fixed-point sum, rounded
            return ((rgb.astype(np.uint32) @ _LUMA + 0x8000) >> 16).astype(np.uint8)[..., None]
        return (rgb.astype(np.float32) @ (_LUMA / 65536).astype(np.float32))[..., None]
    if have == 4 and want == 3:
        return pixels[..., :3]
    first = pixels.shape[1]
    hint = (
        f" (channels come last: an array [N, {first}, H, W] needs .transpose(0, 2, 3, 1))"
        if first in (1, 3, 4) and first != have
        else ""
    )
    raise DataError(
        f"--data {path}: the images have {have} channels and the spec's input takes {want}; dslc converts gray to "
        f"any count, RGB or RGBA to gray, and RGBA to RGB{hint}"
    )


def _range_checked(path: Path, pixels: np.ndarray, integer: bool) -> np.ndarray:
    """uint8 pixels as they are; other integers checked for 0..255 and made uint8; floats
    checked for 0..1 (finite) and made float32: the range the embedded digits have."""
    if integer and pixels.dtype == np.uint8:
        return pixels
    low, high = (0, 255) if integer else (0.0, 1.0)
    for start in range(0, len(pixels), _CHUNK):
        chunk = np.asarray(pixels[start : start + _CHUNK])
        bad = ~((chunk >= low) & (chunk <= high))  # NaN is never in range
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), chunk.shape)
            value = chunk[at]
            expected = "integer pixels are 0..255" if integer else "float pixels are in 0..1 (divide 0..255 by 255)"
            raise DataError(f"--data {path}: image {start + int(at[0]):,} has a pixel of {value}; {expected}")
    return pixels.astype(np.uint8 if integer else np.float32)


def _check_labels(path: Path, labels: np.ndarray, classes: int) -> None:
    bad = (labels < 0) | (labels >= classes)
    if bad.any():
        first, more = int(np.argmax(bad)), int(bad.sum()) - 1
        raise DataError(
            f"--data {path}: label {int(labels[first])} (image {first:,}) is outside the spec's {classes} classes "
            f"(labels 0 .. {classes - 1})" + (f", as are {more:,} more" if more else "")
        )


# --- resizing ------------------------------------------------------------------------------------


def _crop_box(height: int, width: int, shape: ImageShape) -> tuple[float, float, float, float]:
    """The largest box about the centre of a height x width image with the spec's aspect
    ratio, as Pillow's (left, top, right, bottom)."""
    if width * shape.height > height * shape.width:  # wider than the spec's: crop the sides
        kept = height * shape.width / shape.height
        return ((width - kept) / 2, 0.0, (width + kept) / 2, float(height))
    kept = width * shape.height / shape.width
    return (0.0, (height - kept) / 2, float(width), (height + kept) / 2)


def _fit(image: np.ndarray, shape: ImageShape) -> np.ndarray:
    """One image [h, w, C] (uint8 or float32) cropped to the spec's aspect ratio and resized
    to [H, W, C], a channel at a time (Pillow resizes 8-bit and float planes alike)."""
    from PIL import Image

    box = _crop_box(image.shape[0], image.shape[1], shape)
    planes = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(image[:, :, k])).resize(
                (shape.width, shape.height), Image.Resampling.BILINEAR, box=box
            )
        )
        for k in range(image.shape[2])
    ]
    return np.stack(planes, axis=-1)


# --- a folder of class folders ------------------------------------------------------------------


def _walk(folder: Path) -> list[tuple[Path, list[str], list[str]]]:
    """os.walk in sorted order, hidden files and folders left out."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.append((Path(root), dirs[:], sorted(n for n in names if not n.startswith("."))))
    return found


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _image_folder(folder: Path, shape: ImageShape, classes: int, model: str) -> Images:
    if shape.channels not in _MODES:
        raise DataError(
            f"--data {folder}: image files have 1 (gray), 3 (RGB) or 4 (RGBA) channels and spec `{model}`'s "
            f"input takes {shape.channels}; an .npz or images.npy with that many can feed it"
        )
    top = _walk(folder)[0]
    names, loose = top[1], [n for n in top[2] if _is_image_name(n)]
    if loose:
        where = "beside the class sub-folders" if names else "directly in it, with no class sub-folders"
        raise DataError(
            f"--data {folder}: {len(loose)} image files ({loose[0]}, ...) lie {where}; put each class's images in "
            "a sub-folder named after the class"
        )
    found = {name: [root / n for root, _, files in _walk(folder / name) for n in files] for name in names}
    images = {name: [p for p in paths if _is_image_name(p.name)] for name, paths in found.items()}
    if not any(images.values()):
        raise DataError(
            f"--data {folder}: it holds no image files ({', '.join(IMAGE_EXTENSIONS)}) in class sub-folders; {_FORMATS}"
        )
    if len(names) > classes:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise DataError(
            f"--data {folder}: {len(names)} class sub-folders ({shown}) but spec `{model}` tells {classes} classes "
            f"apart (labels 0 .. {classes - 1})"
        )
    empty = [name for name in names if not images[name]]
    if empty:
        raise DataError(
            f"--data {folder}: the class sub-folder `{empty[0]}` holds no image files ({', '.join(IMAGE_EXTENSIONS)})"
        )
    paths = [p for name in names for p in images[name]]
    labels = [label for label, name in enumerate(names) for _ in images[name]]
    counts = [len(images[name]) for name in names]
    skipped = [p for name in names for p in found[name] if not _is_image_name(p.name)]
    digest = hashlib.sha256()
    pixels = np.empty((len(paths), shape.height, shape.width, shape.channels), np.uint8)
    for i, path in enumerate(paths):
        data = _read(path)
        digest.update(f"{path.relative_to(folder).as_posix()}:{len(data)}:".encode() + data)
        pixels[i] = _decode(path, data, shape)
    mapping = ", ".join(f"{label} {name} ({counts[label]:,})" for label, name in enumerate(names))
    notes = [f"classes (label, sub-folder, images): {mapping}"]
    if skipped:
        shown = ", ".join(p.relative_to(folder).as_posix() for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        files = f"{len(skipped)} file{'s' if len(skipped) > 1 else ''}"
        notes.append(f"skipped {files} without an image extension in the class sub-folders: {shown}")
    what = f"{len(paths):,} in {len(names)} class sub-folders, as {shape.describe()}"
    fingerprint = digest.hexdigest()[:16]
    return _split(folder, pixels, np.asarray(labels, np.int64), f"images in {folder}", what, fingerprint, tuple(notes))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"--data {path}: cannot read it: {exc.strerror or exc}") from None


def _decode(path: Path, data: bytes, shape: ImageShape) -> np.ndarray:
    """An image file's pixels [H, W, C] uint8, fitted to the spec as arrays are."""
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as opened:
            # Turned as the camera's EXIF orientation says, as viewers show it.
            image = ImageOps.exif_transpose(opened)
            if image.mode in _DEEP_MODES:
                raise DataError(
                    f"--data {path}: its pixels are {image.mode} (more than 8 bits a channel), which dslc does not "
                    "scale; save it with 8 bits a channel"
                )
            if image.mode in ("P", "PA") and "transparency" in image.info:
                image = image.convert("RGBA")  # the palette's transparency as alpha, which the next line drops
            image = image.convert(_MODES[shape.channels])
            if image.size != (shape.width, shape.height):
                box = _crop_box(image.height, image.width, shape)
                image = image.resize((shape.width, shape.height), Image.Resampling.BILINEAR, box=box)
            pixels = np.asarray(image, dtype=np.uint8)
    except DataError:
        raise
    except Exception as exc:  # decoders of arbitrary bytes raise many kinds (OSError, SyntaxError, struct.error)
        raise DataError(f"--data {path}: cannot read it as an image: {exc}") from None
    return pixels.reshape(shape.height, shape.width, shape.channels)


# --- the split and the batches --------------------------------------------------------------------


def _split(
    path: Path,
    pixels: np.ndarray,
    labels: np.ndarray,
    source: str,
    what: str,
    fingerprint: str,
    notes: tuple[str, ...] = (),
) -> Images:
    """The images with a fixed share held out: the first of a permutation seeded 0, as the
    digits' split is drawn, so every run (and every process) holds out the same ones."""
    n = len(labels)
    if n < 2:
        raise DataError(f"--data {path}: one image cannot be both trained on and held out; give at least 2")
    count = max(1, round(n * HELD_OUT))
    order = np.random.default_rng(0).permutation(n)
    held_out, train = np.sort(order[:count]), np.sort(order[count:])
    description = f"{source} ({what}; {count:,} held out)"
    return Images(
        pixels, labels, held_out, train, description, f"{source} (the {count:,} held out)", fingerprint, notes
    )


@dataclass(frozen=True)
class ImageBatches:
    """Batches of an image set for a spec's image and label inputs, drawn without replacement
    an epoch at a time (`digits.epoch_order`), as the digits are."""

    data: Images = field(repr=False)
    shape: ImageShape
    images: ir.Input
    targets: ir.Input
    classes: int  # labels below it; with `mse`, the width of the one-hot rows
    part: Literal["train", "held_out"] = "train"

    @property
    def description(self) -> str:
        return self.data.held_out_description if self.part == "held_out" else self.data.description

    @property
    def unit(self) -> str:
        return "samples"

    @property
    def per_batch(self) -> int:
        return self.images.type.shape[0]

    @property
    def fingerprint(self) -> str:
        return self.data.fingerprint

    @property
    def notes(self) -> tuple[str, ...]:
        return self.data.notes

    @property
    def held_out(self) -> ImageBatches | None:
        if self.part == "held_out":
            return None
        return ImageBatches(self.data, self.shape, self.images, self.targets, self.classes, "held_out")

    @functools.cached_property
    def _drawn(self) -> np.ndarray:
        return self.data.train if self.part == "train" else self.data.held_out

    def batch(self, seed: int, step: int, rows: np.ndarray | None = None) -> dict[str, Any]:
        """Every row is made whatever `rows` asks: a batch of images is small beside a step."""
        chosen = self._drawn[epoch_order(len(self._drawn), self.per_batch, seed, step)]
        # Sorted for the memory map's sake (reads in file order), then put back in draw order.
        ascending = np.argsort(chosen, kind="stable")
        pixels = np.empty((len(chosen), *self.data.pixels.shape[1:]), self.data.pixels.dtype)
        pixels[ascending] = self.data.pixels[chosen[ascending]]
        scaled = pixels.astype(np.float32) / 255 if pixels.dtype == np.uint8 else pixels.astype(np.float32)
        if self.shape.flat:
            scaled = scaled.reshape(len(scaled), -1)
        labels = self.data.labels[chosen]
        one_hot = self.targets.type.dtype not in ir.INT_DTYPES  # mse regresses one-hot rows
        target = np.eye(self.classes, dtype=np.float32)[labels] if one_hot else labels.astype(np.int32)
        return {self.images.name: scaled, self.targets.name: target}
