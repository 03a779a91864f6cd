"""Compiled per-device temp memory of one gradient step, by pipeline schedule and microbatches.

Targets for the V schedules (two chunks per stage, placed in a V): ZB-V at most 1.1x 1F1B's
memory, V-Half below it.

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

KINDS = ("gpipe", "1f1b", "zb-h1", "zb-v", "v-half")
# The V schedules run two chunks per stage.
VIRTUAL = {"zb-v": 2, "v-half": 2}


def temp_bytes(text: str, kind: str, microbatches: int, mesh: str, rows: int) -> int:
    text = re.sub(r"schedule \S+", f"schedule {kind}", text)
    text = re.sub(r"microbatches \d+", f"microbatches {microbatches}\n  virtual {VIRTUAL.get(kind, 1)}", text)
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
    print(f"{'M':>4} " + " ".join(f"{k:>12}" for k in KINDS) + "   1f1b/gpipe  zb-v/1f1b  v-half/1f1b")
    for m in counts:
        row = {k: temp_bytes(text, k, m, args.mesh, args.rows) for k in KINDS}
        print(
            f"{m:>4} " + " ".join(f"{row[k]:>12,}" for k in KINDS) + f"   {row['1f1b'] / row['gpipe']:>11.3f}"
            f"  {row['zb-v'] / row['1f1b']:>9.3f}  {row['v-half'] / row['1f1b']:>11.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
