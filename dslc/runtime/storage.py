"""How a program's weights are stored, and how they map to their per-layer names.

A stored array is one weight, a repeat's weight for all its layers (the layer index first:
`blocks.*.attn.q`), or one row per pipeline stage. Weights are exported and imported one by
one under stable dotted names (`blocks.3.attn.q`), whatever the storage, so a weights file
loads on any mesh. Plain Python and numpy: the compiler's planner reads the same rules.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple


def fan_in(n: int, gain: float = 1.0) -> str:
    """The initializer of a weight that sums `n` inputs into each output: normal, with
    standard deviation 1/sqrt(n) (times `gain`), as "normal:STD"."""
    std = n**-0.5 if gain == 1.0 else n**-0.5 * gain
    return f"normal:{std!r}"


class Row(NamedTuple):
    """What one stage's row of a per-stage array holds: a weight of its own shape (padded to
    the row's), initialised its own way; `first` is the first layer of a repeat's share."""

    name: str
    shape: tuple[int, ...]
    init: str
    first: int = 0


class Parameter(NamedTuple):
    """A stored array of trainable state and where it lives."""

    shape: tuple[int, ...]
    dtype: str
    init: str  # "zeros", "ones", "normal:STD" (`fan_in(n)` writes one), or "rows" (each row its own)
    sharding: Any  # a PartitionSpec: where it lives between steps
    # Where its gradient and its optimizer state live, when not like the array itself: ZeRO
    # stage 2 and up split the gradient over the data axes, stage 1 and up the state.
    grad_sharding: Any = None
    optimizer_sharding: Any = None
    # A repeat's weight: how many leading dimensions each `*` of its name spans.
    layers: tuple[int, ...] = ()
    # One row per pipeline stage: what each stage's row holds.
    rows: tuple[Row | None, ...] = ()
    # Under a pipeline: the dimension whose pieces are each stage's own (a repeat's layers,
    # or rows), or the dimension a weight used by one stage is split along over the stages
    # between steps (the step gathers it for the stages).
    stage_rows: int | None = None
    stage_split: int | None = None
    # Elements of padding at the end of each of a weight's own dimensions (a vocabulary padded
    # to split evenly): stored, zero, and left out when weights are exported one by one.
    padding: tuple[int, ...] = ()

    @property
    def update_sharding(self) -> Any:
        """Where the optimizer updates it: where its optimizer state lives (its piece of it
        under ZeRO), which is where the step's sum over the data axes leaves its gradient."""
        return self.sharding if self.optimizer_sharding is None else self.optimizer_sharding


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (a name, a tuple of names, or None)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def expand_names(pattern: str, lengths: tuple[int, ...], first: int = 0) -> list[str]:
    """The per-layer names a stacked name stands for: `blocks.*.attn.q` with lengths (2,) is
    `blocks.0.attn.q`, `blocks.1.attn.q`; the first `*` counts from `first`."""
    names = [""]
    starts = iter((first, *(0,) * (len(lengths) - 1)))
    counts = iter(lengths)
    for part in pattern.split("."):
        if part == "*":
            start, count = next(starts), next(counts)
            names = [f"{n}{start + i}." for n in names for i in range(count)]
        else:
            names = [f"{n}{part}." for n in names]
    return [n[:-1] for n in names]


class Held(NamedTuple):
    """One weight in a stored array: its per-layer name, where it is in the array (an index of
    its leading dimensions; padding aside), its shape and how it is initialised."""

    name: str
    at: tuple[int, ...]
    shape: tuple[int, ...]
    init: str


def weight_names(name: str, p: Parameter) -> list[Held]:
    """Every weight a stored array holds, in the array's order."""
    out: list[Held] = []
    if p.rows:
        for r, row in enumerate(p.rows):
            if row is None:
                continue
            stars = row.name.count("*")
            dims = row.shape[:stars]
            indices = itertools.product(*map(range, dims))  # row-major, as the names run
            for index, layer in zip(indices, expand_names(row.name, dims, row.first), strict=True):
                out.append(Held(layer, (r, *index), row.shape[stars:], row.init))
        return out
    dims = p.shape[: sum(p.layers)]
    lengths, at = [], 0
    for span in p.layers:
        lengths.append(math.prod(dims[at : at + span]))
        at += span
    inner = p.shape[len(dims) :]
    if p.padding:
        inner = tuple(n - pad for n, pad in zip(inner, p.padding, strict=True))
    indices = itertools.product(*map(range, dims))  # row-major, as the names run
    names = expand_names(name, tuple(lengths))
    return [Held(layer, index, inner, p.init) for index, layer in zip(indices, names, strict=True)]


def to_weights(parameters: dict[str, Parameter], arrays: dict[str, Any]) -> dict[str, Any]:
    """Stored arrays -> every weight by its per-layer name (numpy copies, padding dropped)."""
    import numpy as np  # here, not above: the compiler's front end reads this module without numpy

    out = {}
    for name, p in parameters.items():
        value = np.asarray(arrays[name])
        # A stored array of another shape would hand out slices of the wrong numbers.
        if value.shape != p.shape:
            raise ValueError(f"stored array {name} has shape {value.shape}, not {p.shape}")
        for held in weight_names(name, p):
            out[held.name] = np.array(value[held.at][tuple(slice(0, n) for n in held.shape)], copy=True)
    return out


def from_weights(parameters: dict[str, Parameter], weights: dict[str, Any]) -> dict[str, Any]:
    """Every weight by its per-layer name -> the stored arrays, as numpy (padding zero). The
    caller checks names and shapes first."""
    import numpy as np  # here, not above: the compiler's front end reads this module without numpy

    out = {}
    for name, p in parameters.items():
        # In the weights' own dtype: the caller casts to the stored dtype as it places them.
        held = weight_names(name, p)
        value = np.zeros(p.shape, np.asarray(weights[held[0].name]).dtype)
        for h in held:
            value[h.at][tuple(slice(0, n) for n in h.shape)] = np.asarray(weights[h.name], dtype=value.dtype)
        out[name] = value
    return out


def shapes_of(parameters: dict[str, Parameter]) -> dict[str, tuple[int, ...]]:
    """Every weight's per-layer name and shape."""
    return {held.name: held.shape for name, p in parameters.items() for held in weight_names(name, p)}
