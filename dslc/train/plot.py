"""The loss curve as a PNG, drawn into a pixel grid and encoded with zlib and struct.

A plotting library would be a large dependency for one line chart. The picture: the raw
loss of every step in a light colour, its moving average in a dark one, the held-out loss
of each evaluation as dots joined by a line, grid lines, the axes' titles and a legend, and
the loss range and step range written in a 3x5 pixel font.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 32, 40  # margins around the plot area (pixels)
_SCALE = 2  # font pixels per glyph pixel
_WHITE, _GRID, _AXIS = (255, 255, 255), (228, 228, 228), (90, 90, 90)
_RAW, _SMOOTH, _HELD_OUT = (166, 200, 236), (24, 90, 170), (222, 110, 20)

# 3 columns x 5 rows each, row by row.
_GLYPHS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "-": "000000111000000",
    "+": "000010111010000",
    "e": "010101111100011",
    " ": "000000000000000",
    "a": "000011101101011",
    "d": "001011101101011",
    "h": "100110101101101",
    "l": "110010010010111",
    "m": "000110111101101",
    "o": "000010101101010",
    "p": "000110101110100",
    "r": "000101110100100",
    "s": "000011110011110",
    "t": "010111010010011",
    "u": "000101101101011",
    "w": "000101101111101",
}


def loss_curve_png(steps: Sequence[int], losses: Sequence[float], held_out: Sequence[tuple[int, float]] = ()) -> bytes:
    """A WIDTH x HEIGHT PNG of loss against step, with `held_out` (step, loss) points."""
    image = np.full((HEIGHT, WIDTH, 3), _WHITE, dtype=np.uint8)
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT - 1, TOP, HEIGHT - BOTTOM - 1
    for i in range(5):
        image[y0 + (y1 - y0) * i // 4, x0 : x1 + 1] = _GRID
    image[y0 : y1 + 1, x0] = _AXIS
    image[y1, x0 : x1 + 1] = _AXIS
    _text(image, "loss", x0 - 6, y0 - 8 - 5 * _SCALE, align_right=True)
    _text(image, "step", (x0 + x1) // 2 + 8 * _SCALE, y1 + 8, align_right=True)
    legend = [("raw loss", _RAW), ("smoothed", _SMOOTH)] + ([("held-out", _HELD_OUT)] if held_out else [])
    _legend(image, legend, x1, y0 - 8 - 5 * _SCALE)
    finite = [(s, v) for s, v in zip(steps, losses, strict=True) if np.isfinite(v)]
    evaluated = [(s, v) for s, v in held_out if np.isfinite(v)]
    if finite:
        s = np.array([p[0] for p in finite], dtype=float)
        v = np.array([p[1] for p in finite], dtype=float)
        lo, hi = min([float(v.min()), *(e for _, e in evaluated)]), max([float(v.max()), *(e for _, e in evaluated)])
        if hi == lo:  # a flat line still needs a non-empty range
            lo, hi = lo - 0.5, hi + 0.5
        first, last = float(s[0]), float(s[-1])

        def x(steps: np.ndarray) -> np.ndarray:
            return x0 + (steps - first) / max(last - first, 1.0) * (x1 - x0)

        def y(values: np.ndarray) -> np.ndarray:
            return y1 - (values - lo) / (hi - lo) * (y1 - y0)

        xs, ys, smooth = x(s), y(v), y(_moving_average(v))
        # Two points per pixel column are all the picture can show, however long the run.
        keep = np.unique(np.linspace(0, len(xs) - 1, min(len(xs), 2 * WIDTH)).astype(int))
        _polyline(image, xs[keep], ys[keep], _RAW)
        _polyline(image, xs[keep], smooth[keep], _SMOOTH)
        if evaluated:
            ex = np.clip(x(np.array([e[0] for e in evaluated], dtype=float)), x0, x1)
            ey = y(np.array([e[1] for e in evaluated], dtype=float))
            _polyline(image, ex, ey, _HELD_OUT)
            for px, py in zip(np.rint(ex).astype(int), np.rint(ey).astype(int), strict=True):
                image[max(py - 2, 0) : py + 3, max(px - 2, 0) : px + 3] = _HELD_OUT
        _text(image, f"{hi:.4g}", x0 - 6, y0, align_right=True)
        _text(image, f"{lo:.4g}", x0 - 6, y1 - 5 * _SCALE, align_right=True)
        _text(image, str(int(first)), x0, y1 + 8, align_right=False)
        _text(image, str(int(last)), x1, y1 + 8, align_right=True)
    return encode_png(image)


def _legend(image: np.ndarray, entries: list[tuple[str, tuple[int, int, int]]], right: int, top: int) -> None:
    """Each entry as a short line in its colour and its name, right-aligned at `right`."""
    advance = 4 * _SCALE
    x = right
    for name, colour in reversed(entries):
        _text(image, name, x, top, align_right=True)
        x -= len(name) * advance + 4
        image[top + 4 : top + 6, x - 16 : x] = colour
        x -= 16 + 16


def _moving_average(values: np.ndarray) -> np.ndarray:
    """Mean over a window of a twentieth of the run centred on each step (centred, so the
    line does not lag behind a falling loss), narrowed near the ends to what stays centred:
    the first and last points are the data's own, so the line starts where the data do."""
    n = len(values)
    half = np.minimum(max(n // 20, 1) // 2, np.minimum(np.arange(n), n - 1 - np.arange(n)))
    sums = np.concatenate([[0.0], np.cumsum(values)])
    index = np.arange(n)
    return (sums[index + half + 1] - sums[index - half]) / (2 * half + 1)


def _polyline(image: np.ndarray, xs: np.ndarray, ys: np.ndarray, colour: tuple[int, int, int]) -> None:
    """Connect the points with 2-pixel-thick segments."""
    if len(xs) == 1:
        xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
    for (xa, ya), (xb, yb) in zip(zip(xs[:-1], ys[:-1], strict=True), zip(xs[1:], ys[1:], strict=True), strict=True):
        n = int(max(abs(xb - xa), abs(yb - ya))) + 1
        px = np.rint(np.linspace(xa, xb, n)).astype(int)
        py = np.rint(np.linspace(ya, yb, n)).astype(int)
        image[py, px] = colour
        image[np.minimum(py + 1, image.shape[0] - 1), px] = colour


def _text(image: np.ndarray, text: str, x: int, y: int, align_right: bool) -> None:
    """Write `text` with its top at row y, starting at column x (ending there if right-aligned)."""
    advance = 4 * _SCALE
    if align_right:
        x -= len(text) * advance - _SCALE
    for i, char in enumerate(text):
        bits = np.array([int(b) for b in _GLYPHS.get(char, _GLYPHS[" "])], dtype=bool).reshape(5, 3)
        block = np.kron(bits, np.ones((_SCALE, _SCALE), dtype=bool))
        top, left = y, x + i * advance
        if top < 0 or left < 0 or top + block.shape[0] > image.shape[0] or left + block.shape[1] > image.shape[1]:
            continue
        image[top : top + block.shape[0], left : left + block.shape[1]][block] = _AXIS


def encode_png(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of an array [height, width, 3] of uint8."""
    height, width, _ = image.shape
    # Each scanline starts with its filter type; 0 means the bytes are stored as they are.
    scanlines = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, -1)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits per channel, RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 9))
        + chunk(b"IEND", b"")
    )
