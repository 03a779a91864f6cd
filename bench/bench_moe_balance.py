"""Auxiliary-loss-free balancing against none: how evenly a mixture of experts spreads its
tokens after training, with and without the per-expert bias (`moe(..., balance=u)`).

specs/moe_small.par with 16 dropless experts and no load-balancing loss (`aux_weight=0`, so
that nothing else evens the load), trained `--steps` steps on the embedded text (the same
seed, data and everything else) with `balance=0` and with `balance=--rate`; every
`--eval-every` steps `dslc train` measures the held-out loss and `eval_moe_load_max`, the busiest
expert's choices over the mean (averaged over the layers; 1 is perfectly even, 16 all to
one expert). Prints both runs' figures at each evaluation.

It prints figures and asserts nothing.

    python bench/bench_moe_balance.py [--steps 300] [--rate 0.001] [--eval-every 50]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from dslc import cli

ROOT = Path(__file__).resolve().parent.parent
LINE = "moe: moe(d, hidden, experts, top_k=2, capacity=1.25)"


def spec(rate: float) -> str:
    text = (ROOT / "specs" / "moe_small.par").read_text()
    assert LINE in text and "const experts = 8" in text
    text = text.replace("const experts = 8", "const experts = 16")
    return text.replace(LINE, f"moe: moe(d, hidden, experts, top_k=2, capacity=none, aux_weight=0.0, balance={rate})")


def train(rate: float, steps: int, every: int, where: Path) -> list[dict[str, float]]:
    path = where / f"balance_{rate}.par"
    path.write_text(spec(rate))
    out = where / f"run_{rate}"
    argv = ["train", str(path), "--steps", str(steps), "--eval-every", str(every), "--out", str(out)]
    assert cli.main(argv) == 0, argv
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "eval_moe_load_max" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rate", type=float, default=0.001)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        without = train(0.0, args.steps, args.eval_every, Path(tmp))
        with_bias = train(args.rate, args.steps, args.eval_every, Path(tmp))
    print(f"\nmoe_small, 16 dropless experts, no balancing loss, bias step {args.rate}:")
    print("the busiest expert's choices over the mean on held-out batches (1 is even), and the held-out loss")
    print(f"{'step':>6} {'no bias':>9} {'bias':>9} {'eval loss (no bias)':>20} {'eval loss (bias)':>17}")
    for a, b in zip(without, with_bias, strict=True):
        print(
            f"{a['step']:>6} {a['eval_moe_load_max']:>9.3f} {b['eval_moe_load_max']:>9.3f} "
            f"{a['eval_loss']:>20.4f} {b['eval_loss']:>17.4f}"
        )


if __name__ == "__main__":
    main()
