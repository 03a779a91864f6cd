"""Per-device memory of one attention layer's forward and backward, by context-parallel size.

One causal attention layer (rotary embeddings, an mse loss after it) over a fixed global
sequence, its tokens split over a `context` axis of CP = 1, 2, 4 simulated CPU devices (the
spec's `--mesh`). At CP = 1 it is plain attention, which keeps its [batch, heads, seq, seq]
probabilities; at CP > 1 it is ring attention (`dslc.runtime.attention.ring_attention`), which
keeps only its share of q, k, v and the outputs and one log-sum-exp per query row, and
recomputes the scores block by block in its backward: its largest transient is one block of
scores, (seq / CP)^2 per head.

Figures are XLA's `memory_analysis()` of the compiled gradient step, per device: arguments +
outputs + temp - aliased (see the field notes, section 6: on CPU the temp size tracks what is
kept), as ratios against CP = 1 of the same run, next to what `dslc plan` predicts for the
same step. It prints figures and asserts nothing.

    python bench/bench_context_parallel.py [--seq 1024] [--batch 2] [--dim 64] [--heads 4]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


import dslc
from dslc.plan import plan

SPEC = """model attention_only
mesh context=4
input x: f32[{batch}, {seq} @ context, {dim}]
input y: f32[{batch}, {seq} @ context, {dim}]
forward(x) {{
  attn: attention({dim}, {heads}, rope=true)
  loss: mse(y)
}}
"""


def measure(text: str, mesh: str) -> tuple[tuple[int, int, int, int], int]:
    """XLA's (arguments, outputs, temp, total) bytes per device for the gradient step of
    `text` on `mesh`, and the planner's total for the same step."""
    stats = dslc.compile(text, mesh=mesh).compiled_memory("grads")
    args, out, temp = stats.arguments, stats.outputs, stats.temporaries
    alias = stats.aliased
    analysis = dslc.analyze(text, mesh=mesh)
    assert analysis.program is not None
    return (args, out, temp, args + out + temp - alias), plan(analysis.program).memory.grads_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    sizes = {"batch": args.batch, "seq": args.seq, "dim": args.dim, "heads": args.heads}
    print(
        f"one causal attention layer, batch {args.batch}, seq {args.seq}, dim {args.dim}, {args.heads} heads, "
        "f32: bytes per device of its gradient step (XLA memory analysis)"
    )
    print(
        f"{'CP':>3} {'kernel':>9} {'arguments':>11} {'outputs':>11} {'temp':>13} {'total':>13} {'vs CP=1':>8}"
        f" {'planned':>13} {'plan/XLA':>9}"
    )
    text = SPEC.format(**sizes)
    base = 0
    for cp in (1, 2, 4):
        (a, o, t, total), planned = measure(text, str(cp))
        base = base or total
        kernel = "attention" if cp == 1 else "ring"
        print(
            f"{cp:>3} {kernel:>9} {a:>11,} {o:>11,} {t:>13,} {total:>13,} {total / base:>8.3f} {planned:>13,}"
            f" {planned / total:>9.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
