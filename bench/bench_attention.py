"""Attention's two cores side by side: memory by sequence length, and step time on CPU.

1. Memory: llama_small's gradient step on one device (`--mesh 1x1 --set batch=1`), its
   attention layers forced to `kernel=dense` (every score at once, the probabilities kept)
   and to `kernel=flash` (block by block, keeping the output and a log-sum-exp), at seq 1024
   and 4096: XLA's memory analysis of the compiled step (arguments + outputs + temp - aliased,
   bytes per device), the 4096 / 1024 ratio of each, and `dslc plan`'s figure for the same step
   planned for XLA's CPU backend. The dense core's grows with the square of the sequence.

2. Time: one causal attention layer's gradient step (its core and projections, batch 1,
   8 heads of 64, f32) on one CPU device, dense against flash at seq 256, 1024 and 4096, each
   the median of `--repeats` timed steps after a warm-up, and their ratio, measured in one
   run. Ratios, not absolute times, are what compare across machines.

It prints figures and asserts nothing.

    python bench/bench_attention.py [--repeats 5] [--skip-memory] [--skip-time]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax

import dslc
from dslc.plan import plan

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def with_kernel(text: str, kernel: str) -> str:
    """The spec with every attention layer's core forced to `kernel`."""
    return re.sub(r"attention\(([^)]*)\)", lambda m: f"attention({m.group(1)}, kernel={kernel})", text)


def memory() -> None:
    text = (ROOT / "specs" / "llama_small.par").read_text()
    print("llama_small, gradient step on one device, batch 1: bytes per device (XLA memory analysis)")
    print(f"{'kernel':>7} {'seq':>6} {'XLA':>12} {'vs 1024':>8} {'planned':>12} {'plan/XLA':>9}")
    for kernel in ("dense", "flash"):
        spec = with_kernel(text, kernel)
        base = 0
        for seq in (1024, 4096):
            sizes = {"batch": 1, "seq": seq}
            measured = dslc.compile(spec, "1x1", sizes).compiled_memory("grads").total
            analysis = dslc.analyze(spec, "1x1", sizes)
            assert analysis.program is not None
            planned = plan(analysis.program, backend="cpu").memory.grads_step
            base = base or measured
            print(
                f"{kernel:>7} {seq:>6} {measured / MiB:>10.1f} Mi {measured / base:>8.2f} {planned / MiB:>10.1f} Mi"
                f" {planned / measured:>9.3f}",
                flush=True,
            )


def step_time(kernel: str, seq: int, repeats: int) -> float:
    """Median seconds of one attention layer's gradient step."""
    text = f"""model one
mesh data=1
input x: f32[1, {seq}, 512]
input y: f32[1, {seq}, 512]
forward(x) {{
  attn: attention(512, 8, rope=true, kernel={kernel})
  loss: mse(y)
}}
"""
    program = dslc.compile(text)
    model = program.init(0)
    batch = program.example_batch(0)
    grads = program.stored_grads  # one jitted step: loss and gradients
    jax.block_until_ready(grads(model, batch))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grads(model, batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing(repeats: int) -> None:
    print(f"\none causal attention layer (8 heads of 64, f32), gradient step on one CPU device, median of {repeats}")
    print(f"{'seq':>6} {'dense s':>9} {'flash s':>9} {'flash/dense':>12}")
    for seq in (256, 1024, 4096):
        dense, flash = step_time("dense", seq, repeats), step_time("flash", seq, repeats)
        print(f"{seq:>6} {dense:>9.4f} {flash:>9.4f} {flash / dense:>12.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    if not args.skip_memory:
        memory()
    if not args.skip_time:
        timing(args.repeats)


if __name__ == "__main__":
    main()
