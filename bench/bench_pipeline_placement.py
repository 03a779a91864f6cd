"""Does the pipeline divide the model? Per-device state of every pipelined spec at P = 1, 2, 4.

For each pipelined spec in `specs/` (large ones shrunk with `--set`) and each stage count P
its mesh allows, prints per device:

* `params`, `grads`, `optimizer`: bytes of the stored arrays' shards, read from the shardings
  XLA compiled the training step with (parameters and optimizer state: its arguments;
  gradients: the gradient step's outputs);
* `state`: their sum, and `state / ideal`, where the ideal is the largest stage's share of the
  P = 1 state: state(P = 1) x (the largest stage's weight bytes / all weight bytes), stage
  weights counted from the IR's chunks. Target: at most 1.1;
* `XLA step`: XLA's memory analysis of the whole training step (arguments + outputs + temp -
  aliased), and its ratio to P = 1;
* `plan`: `dslc plan`'s state (params + grads + optimizer) and training-step bytes, and their
  ratio to XLA's.

The data and tensor axes are held fixed, so only the stage count changes along a spec's rows.

    python bench/bench_pipeline_placement.py [SPEC ...]
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

from dslc.lower.devices import request_host_devices

# XLA fixes the number of CPU devices when jax starts: asked for before `import jax`.
request_host_devices(16)

import jax

import dslc
from dslc.ir import nodes as ir
from dslc.plan import plan
from dslc.plan.memory import training_state

SPECS = Path(__file__).resolve().parent.parent / "specs"

# spec -> (overrides that shrink it to a CPU host, mesh per stage count P). The data and tensor
# axes stay fixed along a row so that only P changes.
CASES: dict[str, tuple[dict[str, int], dict[int, str]]] = {
    "seed_mlp_pipeline": ({}, {1: "1x1", 3: "1x3"}),
    # The issue's shrunk seed_hybrid_3d: 2x2x4 must hold at most 0.30x of 2x2x1's step bytes.
    "seed_hybrid_3d": (
        {"layers": 8, "seq": 64, "hidden": 256, "heads": 4},
        {1: "2x2x1", 2: "2x2x2", 4: "2x2x4"},
    ),
    "gpt_small": ({}, {1: "2x2x1", 2: "2x2x2", 4: "2x2x4"}),
    "gpt2": (
        {"vocab": 128, "positions": 32, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 16},
        {1: "2x2x1", 2: "2x2x2", 4: "2x2x4"},
    ),
    "llama": (
        {"vocab": 128, "d": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "layers": 4, "seq": 32, "batch": 16},
        {1: "2x2x1", 2: "2x2x2", 4: "2x2x4"},
    ),
}

# Specs whose stage blocks fix the chunk count: at P = 1 their chunks run as one stage's
# virtual chunks (interleaved), which holds every weight on the one stage.
ONE_STAGE = {"seed_mlp_pipeline": "schedule interleaved-1f1b\n  virtual 3"}


@dataclass(frozen=True)
class Row:
    params: int
    grads: int
    optimizer: int
    step: int
    planned_state: int
    planned_step: int
    largest_stage_share: float

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def per_device(shapes: object, shardings: object) -> int:
    """Bytes of one device's shards of every array in `shapes` (abstract values with `.shape`
    and `.dtype`), split as `shardings` says (an uneven split pads every shard to the largest)."""
    total = 0
    for value, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        total += math.prod(sharding.shard_shape(value.shape)) * value.dtype.itemsize
    return total


def largest_stage_share(program: ir.Program) -> float:
    """The largest stage's weight bytes over all weight bytes, counted per layer from the
    chunks each stage runs (an independent count: it does not look at how arrays are stored)."""
    per_stage: dict[int, int] = {}
    for chunk in program.chunks:
        held = sum(w.type.nbytes * times for layer, times in ir.counted_layers(chunk.nodes) for w in layer.weights)
        stage = chunk.stage if program.pipelined else 0
        per_stage[stage] = per_stage.get(stage, 0) + held
    return max(per_stage.values()) / sum(per_stage.values())


def measure(text: str, mesh: str, overrides: dict[str, int]) -> Row:
    analysis = dslc.analyze(text, mesh=mesh, overrides=overrides or None)
    assert analysis.program is not None, [d.message for d in analysis.diagnostics]
    program = dslc.compile(text, mesh=mesh, overrides=overrides or None)
    with jax.set_mesh(program.mesh):
        train = program.lower("train")
        grads = program.lower("grads").compile()
        compiled = train.compile()
    # The training step's arguments are (params, optimizer state, batch, key); the gradient
    # step returns (loss, gradients).
    (params, opt_state, *_), _ = train.args_info
    (param_shardings, opt_shardings, *_), _ = compiled.input_shardings
    stats = compiled.memory_analysis()
    step = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )
    state = training_state(analysis.program)
    return Row(
        params=per_device(params, param_shardings),
        grads=per_device(grads.out_info[1], grads.output_shardings[1]),
        optimizer=per_device(opt_state, opt_shardings),
        step=int(step),
        planned_state=state.params + state.grads + state.optimizer,
        planned_step=plan(analysis.program).memory.total,
        largest_stage_share=largest_stage_share(analysis.program),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=list(CASES), help=f"spec names (default: {', '.join(CASES)})")
    args = parser.parse_args()
    mib = 2**20
    print(
        f"{'spec':<18} {'mesh':<7} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} {'/ideal':>7} "
        f"{'XLA step':>9} {'/P=1':>6}   {'plan state':>10} {'plan step':>9} {'/XLA':>6}   (MiB per device)"
    )
    for name in args.specs:
        overrides, meshes = CASES[name]
        base: Row | None = None
        for stages, mesh in meshes.items():
            text = (SPECS / f"{name}.par").read_text(encoding="utf-8")
            if stages == 1 and name in ONE_STAGE:
                text = re.sub(r"schedule \S+", ONE_STAGE[name], text)
            row = measure(text, mesh, overrides)
            base = base or row
            ideal = base.state * row.largest_stage_share
            print(
                f"{name if stages == 1 else '':<18} {mesh:<7} {row.params / mib:>8.2f} {row.grads / mib:>8.2f} "
                f"{row.optimizer / mib:>8.2f} {row.state / mib:>8.2f} {row.state / ideal:>7.3f} "
                f"{row.step / mib:>9.2f} {row.step / base.step:>6.3f}   {row.planned_state / mib:>10.2f} "
                f"{row.planned_step / mib:>9.2f} {row.planned_step / row.step:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
