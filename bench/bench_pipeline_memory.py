"""Compiled per-device temp memory of one gradient step, by pipeline schedule and microbatches.

The microbatch size is held fixed (the batch grows with M), so a schedule that keeps every
microbatch's activations (GPipe) grows with M, and one that keeps at most one per stage
(1F1B, ZB-H1) does not. Figures come from XLA's `memory_analysis()` of the compiled step,
per device (see the field notes: on CPU `temp_size_in_bytes` tracks what is kept).

    python bench/bench_pipeline_memory.py [--spec specs/gpt_small.par] [--mesh 1x1x2]
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")


import dslc

KINDS = ("gpipe", "1f1b", "zb-h1")


def temp_bytes(text: str, kind: str, microbatches: int, mesh: str, rows: int) -> int:
    text = re.sub(r"schedule \S+", f"schedule {kind}", text)
    text = re.sub(r"microbatches \d+", f"microbatches {microbatches}", text)
    program = dslc.compile(text, mesh=mesh, overrides={"batch": rows * microbatches})
    return program.compiled_memory("grads").temporaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="specs/gpt_small.par")
    parser.add_argument("--mesh", default="1x1x2", help="a mesh of the spec whose pipeline axis is > 1")
    parser.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    parser.add_argument("--microbatches", default="4,8,16")
    args = parser.parse_args()
    text = Path(args.spec).read_text(encoding="utf-8")
    counts = [int(m) for m in args.microbatches.split(",")]
    print(f"{args.spec} on mesh {args.mesh}, {args.rows} rows per microbatch: compiled temp bytes per device")
    print(f"{'M':>4} " + " ".join(f"{k:>12}" for k in KINDS) + "   1f1b/gpipe")
    for m in counts:
        row = {k: temp_bytes(text, k, m, args.mesh, args.rows) for k in KINDS}
        print(
            f"{m:>4} " + " ".join(f"{row[k]:>12,}" for k in KINDS) + f"   {row['1f1b'] / row['gpipe']:.3f}", flush=True
        )


if __name__ == "__main__":
    main()
