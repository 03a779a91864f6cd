"""What checkpointing every step costs a training run: synchronous and asynchronous saves.

    .venv/bin/python bench/bench_checkpoints.py [--steps N]

llama_small widened (d 384, ffn 1024, 6 layers: 10.0 million parameters, so 120 MB of f32
parameters and Adam moments per checkpoint) on one CPU device, compiled once and trained
three times in one process, each into a fresh run folder:

* none: no checkpoint but the last;
* sync: `--checkpoint-every 1 --sync-checkpoints`: each save is written and committed before
  the next step starts;
* async: `--checkpoint-every 1` (the default mode): each save returns once its arrays are on
  the host, and is written and committed while the next step computes.

Printed for each: the checkpointed state's size, the wall time per step from the end of the
first step (which compiles) to the end of the run (the last save's wait included), its ratio
to `none`, and how long the loop waited in each save. On a CPU the background writes compete
with the step for the same cores, so the wall time hides less than the wait suggests; on an
accelerator the step's compute is not on those cores. It prints figures and asserts nothing
(tests/train/test_train.py checks that resumed runs follow the uninterrupted trajectory).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dslc
from dslc.train.checkpoint import Checkpoints
from dslc.train.loop import TrainOptions, train

SPEC = Path(__file__).resolve().parent.parent / "specs" / "llama_small.par"
WIDE = {"d": 384, "ffn": 1024, "n_layers": 6, "heads": 6, "kv_heads": 3}


class TimedSaves:
    """Wraps Checkpoints.save to add up how long the training loop waits in it."""

    def __init__(self) -> None:
        self.seconds, self.count = 0.0, 0
        self._save = Checkpoints.save

    def __enter__(self) -> TimedSaves:
        def timed(checkpoints: Checkpoints, *args: Any) -> None:
            began = time.perf_counter()
            self._save(checkpoints, *args)
            self.seconds += time.perf_counter() - began
            self.count += 1

        Checkpoints.save = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        Checkpoints.save = self._save  # type: ignore[method-assign]


def measure(program: dslc.Program, steps: int, out: Path, every: int | None, asynchronous: bool) -> tuple[float, float]:
    """Seconds per step after the first, saves included (the run's last save waited for),
    and the seconds per save the loop waited in `save`."""
    began = time.perf_counter()
    with TimedSaves() as saves:
        result = train(program, TrainOptions(steps, out, 0, every, async_checkpoints=asynchronous), log=lambda _: None)
    total = time.perf_counter() - began
    assert result.first_step_s is not None
    return (total - result.first_step_s) / (steps - 1), saves.seconds / saves.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    program = dslc.compile(SPEC, mesh="1x1", overrides=WIDE)
    model = program.init(0)
    state_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(program.init_optimizer(model)))
    state_bytes += sum(a.nbytes for a in model.arrays().values())
    print(f"llama_small {WIDE} on 1 CPU device: {state_bytes / 1e6:.1f} MB of state per checkpoint")
    print(f"{'saves':<8} {'s/step':>8} {'ratio':>7} {'s waited per save':>18}")
    with tempfile.TemporaryDirectory() as scratch:
        runs = {
            "none": (None, True),
            "sync": (1, False),
            "async": (1, True),
        }
        baseline = None
        for name, (every, asynchronous) in runs.items():
            seconds, waited = measure(program, args.steps, Path(scratch) / name, every, asynchronous)
            baseline = baseline or seconds
            print(f"{name:<8} {seconds:>8.3f} {seconds / baseline:>7.2f} {waited:>18.3f}")


if __name__ == "__main__":
    main()
