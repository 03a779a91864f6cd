"""Handwritten digits for image classifiers, shipped inside dslc (`digits.csv.gz`, 57 KB).

The data are the test set of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), in the copy scikit-learn ships as
`load_digits`: 1797 images of 8x8 pixels with values 0..16, one per row, followed by the
label 0..9. Depending on scikit-learn (and scipy) for 57 KB of data would add far more to
every install than the file itself.

A spec's float input of width side*side receives the images resampled to side x side
(bilinear): the reference MLP's 784 inputs get 28x28 digits, MNIST's layout; an image input
[batch, side, side, channels] (a vision transformer's, a convolution's) gets them as images,
the gray level in every channel. Pixels are scaled to [0, 1]. `HELD_OUT` of the digits, a
fixed draw, are kept out of training for `--eval-every`.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from dslc.ir import nodes as ir

CLASSES = 10
NATIVE_SIDE = 8
HELD_OUT = 297  # of the 1797 digits, kept for evaluation: 1500 train
_FILE = Path(__file__).with_name("digits.csv.gz")


@dataclass(frozen=True)
class Digits:
    images: np.ndarray  # f32[n, 8, 8] in [0, 1]
    labels: np.ndarray  # i32[n]
    fingerprint: str


@functools.cache
def load_digits() -> Digits:
    raw = _FILE.read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode("ascii").splitlines(), delimiter=",", dtype=np.int32)
    images = (table[:, :-1] / 16.0).astype(np.float32).reshape(-1, NATIVE_SIDE, NATIVE_SIDE)
    return Digits(images, table[:, -1], hashlib.sha256(raw).hexdigest()[:16])


def image_side(width: int) -> int | None:
    """The side of a square image of `width` pixels, or None when there is none."""
    side = math.isqrt(width)
    return side if side * side == width else None


def input_side(images: ir.TensorType) -> int | None:
    """The side of the square images an input takes: [batch, side * side] flattened, or
    [batch, side, side, channels]; None when it takes none."""
    shape = images.shape
    if len(shape) == 2:
        return image_side(shape[1])
    return shape[1] if len(shape) == 4 and shape[1] == shape[2] else None


def resample(images: np.ndarray, side: int) -> np.ndarray:
    """Bilinear resampling of square images [n, s, s] to [n, side, side] (pixel centres
    aligned, edges clamped)."""
    m = _interpolation(images.shape[-1], side)
    return np.einsum("ij,njk,lk->nil", m, images, m).astype(np.float32)


def _interpolation(n_in: int, n_out: int) -> np.ndarray:
    """The [n_out, n_in] matrix that linearly interpolates a row of n_in pixels to n_out."""
    x = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
    lo = np.floor(x).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    w = x - lo
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), lo), 1 - w)
    np.add.at(m, (np.arange(n_out), hi), w)
    return m


def epoch_order(n: int, size: int, seed: int, step: int) -> np.ndarray:
    """Which of `n` examples batch `step` of `size` draws: each epoch is a fresh permutation
    of them seeded by (seed, epoch), and batch k takes positions k*size .. (k+1)*size - 1 of
    the concatenated epochs (so no example repeats within an epoch)."""
    positions = np.arange(step * size, (step + 1) * size)
    epochs = positions // n
    order = np.empty(size, dtype=np.int64)
    for epoch in np.unique(epochs):
        here = epochs == epoch
        order[here] = np.random.default_rng((seed, int(epoch))).permutation(n)[positions[here] % n]
    return order


@dataclass(frozen=True)
class DigitImages:
    """Batches of digits drawn without replacement, an epoch at a time (`epoch_order`)."""

    digits: Digits = field(repr=False)
    images: ir.Input
    targets: ir.Input
    part: Literal["train", "held_out"] = "train"

    @property
    def description(self) -> str:
        side = input_side(self.images.type)
        held = " (held out)" if self.part == "held_out" else f", {HELD_OUT} held out"
        return f"handwritten digits (UCI optdigits, {len(self._drawn)} images as {side}x{side}{held})"

    @property
    def unit(self) -> str:
        return "samples"

    @property
    def per_batch(self) -> int:
        return self.images.type.shape[0]

    @property
    def fingerprint(self) -> str:
        return self.digits.fingerprint

    @property
    def held_out(self) -> DigitImages | None:
        """The digits kept out of training (none kept from those)."""
        return DigitImages(self.digits, self.images, self.targets, "held_out") if self.part == "train" else None

    @functools.cached_property
    def _drawn(self) -> np.ndarray:
        """The digits this part draws from: a fixed split of them all, the same for every run."""
        split = np.random.default_rng(0).permutation(len(self.digits.labels))
        return split[HELD_OUT:] if self.part == "train" else split[:HELD_OUT]

    @functools.cached_property
    def _pixels(self) -> np.ndarray:
        """This part's images as the input takes them: flattened rows, or images whose every
        channel holds the gray level."""
        t = self.images.type
        side = input_side(t)
        assert side is not None, "data.dataset_for admits square images only"
        images = resample(self.digits.images[self._drawn], side)
        if t.rank == 2:
            return images.reshape(len(images), -1)
        return np.repeat(images[..., None], t.shape[3], axis=-1)

    def batch(self, seed: int, step: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The digits live in memory: every row is made whatever `rows` asks."""
        order = epoch_order(len(self._drawn), self.per_batch, seed, step)
        labels = self.digits.labels[self._drawn[order]]
        one_hot = self.targets.type.dtype not in ir.INT_DTYPES  # mse regresses one-hot rows
        target = np.eye(CLASSES, dtype=np.float32)[labels] if one_hot else labels
        return {self.images.name: self._pixels[order], self.targets.name: target}
