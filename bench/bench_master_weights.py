"""f32 training against 16-bit parameters with an f32 master copy, in one run.

    .venv/bin/python bench/bench_master_weights.py [--steps N]

gpt_small (data x model x stage 2x4x2, 1F1B) and llama_small (data x model 2x4, ZeRO 1) on 16
simulated CPU devices, each compiled twice in one process:

* f32: `param_dtype f32`, `compute_dtype f32`: parameters, gradients, moments in f32;
* master: `param_dtype bf16`, `compute_dtype bf16`, `master_dtype f32`: 16-bit parameters and
  gradients, the f32 master and moments in the optimizer state (split by ZeRO where the spec
  asks for it).

Printed for each: XLA's memory analysis of the compiled training step per device (arguments:
parameters, optimizer state and batch; temporaries), the planner's total for the same step,
and the median wall time of the step. Ratios are master / f32, measured in the same run. CPU
devices are simulated, so step times say little about a GPU's bf16 speed: XLA's CPU backend
computes bf16 by widening it. It prints figures and asserts nothing
(tests/lower/test_master_and_zero.py checks the numerics and the state's layout).
"""

from __future__ import annotations

import re

from dslc.lower.devices import request_host_devices

# XLA fixes the number of CPU devices when jax starts: asked for before `import jax`.
request_host_devices(16)

import argparse
import statistics
import time
from pathlib import Path

import jax

import dslc
from dslc.lower.program import Program
from dslc.plan import plan

SPECS = Path(__file__).resolve().parent.parent / "specs"
VARIANTS = {
    "f32": ("param_dtype f32", "compute_dtype f32"),
    "master": ("param_dtype bf16", "compute_dtype bf16", "master_dtype f32"),
}


def variant(text: str, settings: tuple[str, ...]) -> str:
    """The spec with its precision settings replaced by `settings`."""
    text = re.sub(r"^\s*(param_dtype|compute_dtype|master_dtype)\b.*\n", "", text, flags=re.M)
    return text.replace("train {", "train {\n" + "".join(f"  {s}\n" for s in settings), 1)


def measure(program: Program, steps: int) -> tuple[int, int, int, float]:
    """(XLA arguments bytes, XLA temporaries bytes, planned total bytes, median step seconds)."""
    memory = program.compiled_memory("train")
    planned = plan(program.ir).memory.total
    model = program.init(0)
    state = program.init_optimizer(model)
    batch = program.example_batch(0)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        state, _ = program.train_step(model, state, batch, i)  # returns a float: the step is done
        if i >= 2:  # the first runs compile and warm caches up
            times.append(time.perf_counter() - start)
    return memory.arguments, memory.temporaries, planned, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    for name in ("gpt_small", "llama_small"):
        text = (SPECS / f"{name}.par").read_text()
        results = {}
        for label, settings in VARIANTS.items():
            program = dslc.compile(variant(text, settings))
            results[label] = measure(program, args.steps)
            arguments, temporaries, planned, step_s = results[label]
            print(
                f"{name:11} {label:6}  XLA arguments {arguments:>10,} B, temporaries {temporaries:>10,} B,"
                f" planned total {planned:>10,} B;  step {step_s * 1e3:7.1f} ms"
            )
        (a32, t32, p32, s32), (am, tm, pm, sm) = results["f32"], results["master"]
        print(
            f"{name:11} master / f32: arguments {am / a32:.3f}, temporaries {tm / t32:.3f},"
            f" arguments + temporaries {(am + tm) / (a32 + t32):.3f}, planned {pm / p32:.3f}, step time {sm / s32:.3f}"
        )


if __name__ == "__main__":
    main()
