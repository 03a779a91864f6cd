"""Gradients summed over the data axes once per step against once per slice, in one run.

    .venv/bin/python bench/bench_data_parallel.py [--steps N]

Two steps that cut their batch into slices, on 16 simulated CPU devices: gpt_small as written
(1F1B over `stage`, 4 microbatches, data x model x stage 2x4x2) and tiny with `accumulate 4`
(data x model 2x2). Each is compiled twice in one process, from the same generated module:

* per step (dslc's lowering): each device works through its own rows of the batch and the
  gradients are summed over `data` once, after the last slice (`data_parallel`);
* per slice (the lowering before it): the same step with its gradients left to XLA's
  partitioner, which all-reduces every slice's gradients over `data` where they are made.

Printed for each: the bytes one device sends per step in collectives over `data`, read from
the compiled training step's HLO (`dslc.lower.hlo`): each collective's ring bytes times the
times it runs, the trip counts of the loops around it, except that a branch of the pipeline's
tick switches runs once per microbatch rather than once per tick, and on the busiest stage
(each switch's heaviest branch); how many of those collectives sit inside a loop; and the
median wall time of the compiled training step. Ratios are per step / per slice, measured in
the same run. It prints figures and asserts nothing (tests/lower/test_data_parallel.py checks the
HLO, the numerics tests the numbers).
"""

from __future__ import annotations

from dslc.lower.devices import request_host_devices

# XLA fixes the number of CPU devices when jax starts: asked for before `import jax`.
request_host_devices(16)

import argparse
import functools
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax

import dslc
from dslc.lower.hlo import Collective, collectives
from dslc.lower.program import Program, load_module
from dslc.runtime.training import accumulate_gradients, init_optimizer, make_train_step

SPECS = Path(__file__).resolve().parent.parent / "specs"
CASES = {
    "gpt_small (1f1b, 4 microbatches)": (SPECS / "gpt_small.par").read_text(),
    "tiny (accumulate 4)": (SPECS / "tiny.par").read_text().replace("train {", "train {\n  accumulate 4"),
}


def per_slice_module(program: Program) -> Any:
    """The program's module once more, its `gradients` the lowering before `data_parallel`:
    the slices' gradients summed by XLA's partitioner as each slice makes them."""
    module = load_module(program.source, program.ir.name)

    def gradients(params: Any, batch: Any, key: Any, mesh: Any) -> Any:
        once = functools.partial(module.value_and_grad, mesh=mesh)
        if module.ACCUMULATE == 1:
            return once(params, batch, key)
        return accumulate_gradients(once, params, batch, key, module.ACCUMULATE, getattr(module, "loss_count", None))

    module.gradients = gradients
    return module


def data_bytes_per_step(found: list[Collective], program: Program) -> tuple[int, int]:
    """Bytes one device sends per step over `data`, and how many such collectives sit in a
    loop. A branch of the tick's switches runs on M of the T ticks (each chunk forward and
    backward once per microbatch); each switch counts its heaviest branch (the busiest stage)."""
    mesh = program.mesh
    pipeline = program.ir.pipeline if program.ir.pipelined else None
    ticks = len(program.module.SCHEDULE["op"]) if pipeline else 1
    plain, branches, in_loop = 0, defaultdict(int), 0
    for c in found:
        if "data" not in c.axes(mesh.axis_names, mesh.devices.shape):
            continue
        in_loop += c.in_loop
        runs = math.prod(c.loops)
        if c.branches and pipeline is not None:
            runs = runs // ticks * pipeline.microbatches
            branches[c.branches[0]] += c.sent_bytes * runs
        else:
            plain += c.sent_bytes * runs
    heaviest: dict[str, int] = defaultdict(int)
    for (switch, _), sent in branches.items():
        heaviest[switch] = max(heaviest[switch], sent)
    return plain + sum(heaviest.values()), in_loop


def measure(program: Program, module: Any, steps: int) -> tuple[int, int, float, float]:
    """(bytes over data per step, collectives over data in loops, compile s, median step s)."""
    mesh = program.mesh
    with jax.set_mesh(mesh):
        model = program.init(0)
        params = model.arrays()
        state = init_optimizer(module.PARAMETERS, params, program.optimizer, mesh, module.MASTER_DTYPE)
        batch = program.place(program.example_batch(0), loss=True)
        step = make_train_step(module.gradients, module.PARAMETERS, mesh, program.optimizer, module.MASTER_DTYPE)
        start = time.perf_counter()
        compiled = step.lower(params, state, batch, jax.random.key(0)).compile()
        compile_s = time.perf_counter() - start
        sent, in_loop = data_bytes_per_step(collectives(compiled.as_text()), program)
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            params, state, loss, _ = compiled(params, state, batch, jax.random.key(i))
            loss.block_until_ready()
            if i >= 2:  # the first runs warm caches up
                times.append(time.perf_counter() - start)
    return sent, in_loop, compile_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parser.parse_args()
    for name, text in CASES.items():
        program = dslc.compile(text)
        print(f"{name}, mesh {'x'.join(map(str, program.mesh.devices.shape))}, data axes {program.module.DATA_AXES}")
        after = measure(program, program.module, args.steps)
        before = measure(program, per_slice_module(program), args.steps)
        for label, (sent, in_loop, compile_s, step_s) in (("per slice", before), ("per step", after)):
            print(
                f"  {label:9}  over data: {sent:>9,} B/step, {in_loop:2} collectives in loops;"
                f"  compile {compile_s:5.1f} s, step {step_s * 1e3:7.1f} ms"
            )
        print(
            f"  per step / per slice: bytes over data {after[0] / before[0]:.3f},"
            f" step time {after[3] / before[3]:.3f}, compile time {after[2] / before[2]:.3f}"
        )


if __name__ == "__main__":
    main()
