"""The planner's bytes per device against XLA's compiled memory analysis, spec by spec.

For each case, prints the planned bytes of the gradient step (`Plan.memory.grads_step`) and
of the whole training step (`Plan.memory.total`) next to XLA's argument + output + temp -
alias for the same compiled functions, and their ratios. The cases: every spec in specs/ at
its default mesh, every pipelined spec on a second mesh (another stage count), and a
repeated-block MLP under each ZeRO stage and FSDP, and issue 17's options on repeated blocks
(16-bit parameters with an f32 master copy, `checkpoint core_attention`). The plan is made
for the backend the steps compile on: on CPU it adds what XLA's CPU backend alone holds
(`dslc.plan.memory.cpu_widening`). This is the table in docs/plan.md; tests/plan/test_plan.py
asserts a few of its rows.

    python bench/bench_plan_accuracy.py                      # the whole table
    python bench/bench_plan_accuracy.py --options            # issue 17's rows
    python bench/bench_plan_accuracy.py gpt_small [--mesh 2x2x4] [--set n_layers=8]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

import dslc
from dslc.frontend import parse_overrides
from dslc.ir.evaluate import ScalarValue
from dslc.plan import plan

SPECS = Path(__file__).resolve().parent.parent / "specs"
# Compiled at a reduced size: at full size seed_hybrid_3d, gpt2 and llama are too large for a
# CPU host, and gpt3_175b is planned on paper only.
REDUCED: dict[str, dict[str, ScalarValue]] = {
    "seed_hybrid_3d": {"layers": 4, "seq": 64, "hidden": 128},
    "gpt2": {"vocab": 128, "positions": 32, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 16},
    "gpt_neox": {"vocab": 128, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 16},
    "llama": {"vocab": 128, "d": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "layers": 4, "seq": 32, "batch": 16},
    "gemma2": {
        "vocab": 128,
        "d": 64,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn": 176,
        "layers": 4,
        "window": 16,
        "seq": 32,
        "batch": 16,
    },
    "t5": {
        "vocab": 128,
        "d": 64,
        "heads": 4,
        "head_dim": 16,
        "ffn": 128,
        "layers": 4,
        "seq": 32,
        "target_seq": 16,
        "batch": 16,
        "buckets": 8,
        "max_distance": 16,
    },
}
SKIPPED = {"gpt3_175b"}
# Each pipelined spec on a second mesh: another number of stages (seed_mlp_pipeline's three
# stages are written out, so it doubles the data axis instead).
SECOND_MESH = {
    "gpt_small": "2x2x4",
    "gpt2": "1x2x4",
    "gpt_neox": "1x2x4",
    "llama": "1x2x4",
    "seed_hybrid_3d": "2x2x4",
    "seed_mlp_pipeline": "2x3",
}
# Issue 16's repeated-block MLP: ZeRO-3 and FSDP split the scan's stacked weights too.
RESIDUAL_MLP = """model residual_mlp
mesh data=8
const d = 512
const n_layers = 8
const batch = 64
input x: f32[batch @ data, d]
input y: f32[batch @ data, d]
block mlp(d) checkpoint full {
  residual {
    up: linear(d, 4 * d)
    gelu()
    down: linear(4 * d, d)
  }
}
forward(x) {
  blocks: repeat n_layers mlp(d)
  loss: mse(y)
}
train {
  SETTING
  optimizer adamw(lr=1e-3)
}
"""
STATE_SETTINGS = ("zero 0", "zero 1", "zero 2", "zero 3", "fsdp data")


def residual_mlp(state: str, checkpoint: str = "full") -> str:
    """The residual MLP under one way of splitting the training state, its blocks
    checkpointed (`full`) or not (`none`)."""
    return RESIDUAL_MLP.replace("SETTING", state).replace("checkpoint full", f"checkpoint {checkpoint}")


# Issue 17's options on repeated blocks: 16-bit parameters and gradients with an f32 master in
# the optimizer state, and Megatron's selective recompute of attention's core.
MASTER = ("param_dtype bf16", "compute_dtype bf16", "master_dtype f32")


def with_master(text: str) -> str:
    """The spec with 16-bit parameters and an f32 master copy instead of its own precision."""
    text = re.sub(r"^\s*(param_dtype|compute_dtype|master_dtype)\b.*\n", "", text, flags=re.M)
    return text.replace("train {", "train {\n" + "".join(f"  {s}\n" for s in MASTER), 1)


def option_cases() -> list[Case]:
    """gpt_small (pipelined) and llama_small with the master copy, llama_small's attention
    blocks with `checkpoint core_attention`, and the residual MLP with the master copy."""
    gpt, llama = ((SPECS / f"{n}.par").read_text() for n in ("gpt_small", "llama_small"))
    return [
        Case("gpt_small master", with_master(gpt)),
        Case("llama_small master", with_master(llama)),
        Case("llama_small core_attn", llama.replace("checkpoint full", "checkpoint core_attention")),
        Case("residual_mlp master", with_master(residual_mlp("zero 1"))),
    ]


@dataclass(frozen=True)
class Case:
    """One row of the table: a spec (a path or its text) on a mesh, with overrides."""

    name: str
    source: str | Path
    mesh: str | None = None
    overrides: dict[str, ScalarValue] = field(default_factory=dict)


def cases() -> list[Case]:
    """Every spec at its default mesh, the pipelined ones on a second mesh, the ZeRO stages."""
    rows = []
    for path in sorted(SPECS.glob("*.par")):
        if path.stem in SKIPPED:
            continue
        reduced = REDUCED.get(path.stem, {})
        rows.append(Case(path.stem, path, None, reduced))
        if path.stem in SECOND_MESH:
            rows.append(Case(path.stem, path, SECOND_MESH[path.stem], reduced))
    rows += [
        Case(f"residual_mlp {s}, checkpoint {c}", residual_mlp(s, c)) for c in ("full", "none") for s in STATE_SETTINGS
    ]
    return rows + option_cases()


def measure(case: Case) -> tuple[int, int, int, int]:
    """(planned gradient step, XLA's, planned training step, XLA's), bytes per device."""
    overrides = case.overrides or None
    analysis = dslc.analyze(case.source, mesh=case.mesh, overrides=overrides)
    assert analysis.program is not None, [d.message for d in analysis.diagnostics]
    program = dslc.compile(case.source, mesh=case.mesh, overrides=overrides)
    import jax  # after the device count is set, as dslc.compile does

    # Planned for the backend it is compiled on (on CPU, with what that backend alone holds).
    memory = plan(analysis.program, backend=jax.default_backend()).memory
    grads, step = program.compiled_memory("grads"), program.compiled_memory("train")
    return memory.grads_step, grads.total, memory.total, step.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", help="spec names or paths (default: the whole table)")
    parser.add_argument("--mesh", help="mesh sizes instead of each spec's default")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a const")
    parser.add_argument("--options", action="store_true", help="only the rows of issue 17's options")
    args = parser.parse_args()
    given = parse_overrides(args.set)
    if args.options:
        rows = option_cases()
    elif args.specs:
        paths = [Path(s) if s.endswith(".par") else SPECS / f"{s}.par" for s in args.specs]
        rows = [Case(p.stem, p, args.mesh, {**REDUCED.get(p.stem, {}), **given}) for p in paths]
    else:
        rows = cases()
    header = f"{'case':<22} {'mesh':<8} {'grads planned':>14} {'XLA':>12} {'ratio':>6}"
    print(f"{header}   {'step planned':>13} {'XLA':>12} {'ratio':>6}")
    worst = 0.0
    for case in rows:
        planned, measured, planned_step, measured_step = measure(case)
        worst = max(worst, abs(planned / measured - 1), abs(planned_step / measured_step - 1))
        print(
            f"{case.name:<22} {case.mesh or 'default':<8} {planned:>14,} {measured:>12,} {planned / measured:>6.3f}   "
            f"{planned_step:>13,} {measured_step:>12,} {planned_step / measured_step:>6.3f}",
            flush=True,
        )
    print(f"largest error: {worst:.1%}", file=sys.stderr)


if __name__ == "__main__":
    main()
