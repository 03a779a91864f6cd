"""A mixture of experts' two forms side by side on CPU: dropless grouped products against
the one-hot capacity dispatch, at 8, 64 and 128 experts.

One `moe` layer's gradient step (router, experts, load-balancing loss; batch 8 sequences of
512 tokens, width 256, each expert 512 wide, top 2, f32, one device): the median of
`--repeats` timed steps after a warm-up, for

* `capacity=1.25` — today's dispatch: one-hot [groups, tokens, experts, slots] tensors, and
  every expert computed on all of its slots, empty ones included;
* `capacity=none` — dropless: the choices sorted by expert and each expert multiplying
  exactly its rows (on CPU in tiles of one expert each, see `dslc.runtime.experts`),

and their ratio, measured in one run; with `--memory`, XLA's memory analysis of each
compiled step too. Ratios, not absolute times, are what compare across machines.

It prints figures and asserts nothing.

    python bench/bench_moe.py [--repeats 5] [--experts 8,64,128] [--memory]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax

import dslc

MiB = 1 << 20


def spec(experts: int, capacity: str) -> str:
    return f"""model experts
mesh data=1
input x: f32[8, 512, 256]
input y: f32[8, 512, 256]
forward(x) {{
  moe: moe(256, 512, {experts}, top_k=2, capacity={capacity})
  loss: mse(y)
}}
"""


def measure(experts: int, capacity: str, repeats: int, memory: bool) -> tuple[float, int]:
    """Median seconds of one gradient step, and the compiled step's bytes (0 unless asked)."""
    program = dslc.compile(spec(experts, capacity))
    model = program.init(0)
    batch = program.example_batch(0)
    step = program.stored_grads  # one jitted step: loss and gradients
    jax.block_until_ready(step(model, batch))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(model, batch))
        times.append(time.perf_counter() - start)
    used = program.compiled_memory("grads").total if memory else 0
    return statistics.median(times), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--experts", default="8,64,128", help="expert counts, comma-separated")
    parser.add_argument("--memory", action="store_true", help="also XLA's memory analysis of each step")
    args = parser.parse_args()
    print(
        f"one moe layer's gradient step on {jax.devices()[0].device_kind}: 8 x 512 tokens, dim 256, hidden 512, top 2"
    )
    header = f"{'experts':>8} {'capacity 1.25':>14} {'dropless':>10} {'dropless/capacity':>18}"
    print(header + (f" {'memory cap.':>12} {'dropless':>10}" if args.memory else ""))
    for experts in (int(e) for e in args.experts.split(",")):
        capacity, capacity_bytes = measure(experts, "1.25", args.repeats, args.memory)
        dropless, dropless_bytes = measure(experts, "none", args.repeats, args.memory)
        line = f"{experts:>8} {capacity * 1e3:>11.1f} ms {dropless * 1e3:>7.1f} ms {dropless / capacity:>18.2f}"
        if args.memory:
            line += f" {capacity_bytes / MiB:>9.1f} Mi {dropless_bytes / MiB:>7.1f} Mi"
        print(line, flush=True)


if __name__ == "__main__":
    main()
