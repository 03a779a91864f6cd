"""What the training loop asks of a data set, and the error for specs none can feed."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class DataError(Exception):
    """The spec's inputs are not something the data sets can feed, or the data are unusable."""


class Dataset(Protocol):
    """Batches for one spec, each a pure function of the seed and the step: resuming at
    step k reads exactly the batches an uninterrupted run would have read from step k on."""

    @property
    def description(self) -> str:
        """One line for the user: what the data are."""
        ...

    @property
    def unit(self) -> str:
        """What throughput counts: "tokens" or "samples"."""
        ...

    @property
    def per_batch(self) -> int:
        """How many of `unit` one batch holds."""
        ...

    @property
    def fingerprint(self) -> str:
        """A short hash of the data, so a resumed run can tell whether they changed."""
        ...

    @property
    def held_out(self) -> Dataset | None:
        """Data kept out of training, to evaluate on; None when there are none."""
        ...

    def batch(self, seed: int, step: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The batch of 0-based step `step` of the run seeded `seed`, one array per declared
        input. With `rows`, only those rows need be read (a process's share of a multi-process
        run); the others may be left zero."""
        ...
