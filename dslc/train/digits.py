"""Handwritten digits for image classifiers, shipped inside dslc (`digits.csv.gz`, 57 KB).

The data are the test set of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin and C. Kaynak, 1998; CC BY 4.0), in the copy scikit-learn ships as
`load_digits`: 1797 images of 8x8 pixels with values 0..16, one per row, followed by the
label 0..9. Depending on scikit-learn (and scipy) for 57 KB of data would add far more to
every install than the file itself.

A spec's float input of width side*side receives the images resampled to side x side
(bilinear): the reference MLP's 784 inputs get 28x28 digits, MNIST's layout. Pixels are
scaled to [0, 1].
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dslc.ir import nodes as ir

CLASSES = 10
NATIVE_SIDE = 8
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


@dataclass(frozen=True)
class DigitImages:
    """Batches of digits drawn without replacement: each epoch is a fresh permutation of
    the data seeded by (seed, epoch), and batch k takes positions k*batch .. (k+1)*batch - 1
    of the concatenated epochs."""

    digits: Digits = field(repr=False)
    images: ir.Input
    targets: ir.Input

    @property
    def description(self) -> str:
        side = image_side(self.images.type.shape[1])
        return f"handwritten digits (UCI optdigits, {len(self.digits.labels)} images as {side}x{side})"

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
    def held_out(self) -> None:
        """Every digit trains: 1797 images leave too few to split off a useful held-out set."""
        return None

    @functools.cached_property
    def _pixels(self) -> np.ndarray:
        side = image_side(self.images.type.shape[1])
        assert side is not None, "data.dataset_for admits square widths only"
        return resample(self.digits.images, side).reshape(len(self.digits.labels), -1)

    def batch(self, seed: int, step: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The digits live in memory: every row is made whatever `rows` asks."""
        n, size = len(self.digits.labels), self.per_batch
        positions = np.arange(step * size, (step + 1) * size)
        epochs = positions // n
        order = np.empty(size, dtype=np.int64)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            order[here] = np.random.default_rng((seed, int(epoch))).permutation(n)[positions[here] % n]
        labels = self.digits.labels[order]
        one_hot = self.targets.type.dtype not in ir.INT_DTYPES  # mse regresses one-hot rows
        target = np.eye(CLASSES, dtype=np.float32)[labels] if one_hot else labels
        return {self.images.name: self._pixels[order], self.targets.name: target}
