"""`dslc import` of a GPT-2-small-sized checkpoint: time and peak memory.

Writes a checkpoint of GPT-2 small's sizes (124M parameters, random f32 weights, one
model.safetensors as `save_pretrained` writes it) to a temporary folder, then runs
`dslc import specs/gpt2.par CHECKPOINT -o weights.npz` in a fresh process and prints its wall
time and peak resident memory (the child's ru_maxrss), against the checkpoint's size: import
reads one tensor at a time, so its peak should stay well under two copies of the model
(the target is at most 1.5x the checkpoint). With `--sharded N` the checkpoint is written as
N files with their index.

    python bench/bench_import.py [--sharded N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.hf_checkpoints import GPT2_CONFIG, gpt2_tensors, write_checkpoint

GPT2_SMALL = {**GPT2_CONFIG, "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}


def write(folder: Path, shards: int) -> None:
    tensors = gpt2_tensors(GPT2_SMALL)
    write_checkpoint(folder, GPT2_SMALL, tensors, shards=shards)
    print(f"checkpoint: {sum(t.size for t in tensors.values()):,} parameters", end="")


def run_measured(command: list[str], log: Path) -> tuple[int, float, int]:
    """Exit status, seconds and peak resident bytes of `command`, from its own rusage. This
    process stays small (the checkpoint is written by another child), because a child starts
    as a copy of its parent and that copy's pages count until it execs."""
    began = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, time.perf_counter() - began, usage.ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharded", type=int, default=1, metavar="N", help="write the checkpoint as N files")
    parser.add_argument("--keep", type=Path, help="write into this folder and keep it")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child that writes the checkpoint
    args = parser.parse_args()
    if args.write:
        write(args.write, args.sharded)
        return
    with tempfile.TemporaryDirectory() as scratch:
        where = args.keep or Path(scratch)
        folder = where / "gpt2-small"
        began = time.perf_counter()
        made = subprocess.run(
            [sys.executable, __file__, "--write", str(folder), "--sharded", str(args.sharded)],
            capture_output=True,
            text=True,
            check=True,
        )
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(
            f"{made.stdout}, {size / 2**20:,.1f} MiB in {args.sharded} file(s), "
            f"written in {time.perf_counter() - began:.1f} s"
        )
        out, log = where / "weights.npz", where / "import.log"
        spec = ROOT / "specs" / "gpt2.par"
        code, seconds, peak = run_measured(
            [sys.executable, "-m", "dslc.cli", "import", str(spec), str(folder), "-o", str(out)], log
        )
        if code != 0:
            sys.exit(f"dslc import failed ({code}):\n{log.read_text()}")
        with np.load(out) as weights:
            written = sum(weights[name].nbytes for name in weights.files)
        print(log.read_text().strip())
        print(
            f"import: {seconds:.2f} s, peak resident memory {peak / 2**20:,.1f} MiB = {peak / size:.2f}x the "
            f"checkpoint (wrote {written / 2**20:,.1f} MiB)"
        )


if __name__ == "__main__":
    main()
