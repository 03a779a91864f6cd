"""Matrix-multiply FLOPs of a traced step, every loop and pipeline tick counted.

XLA's cost analysis counts a loop's body once and a conditional as its costliest branch, so
it cannot compare a pipelined step (one loop over the schedule's ticks, a switch per tick)
with an unpipelined one. This counts the traced jaxpr instead: each `dot_general` costs
2 x (output elements) x (contracted elements) — matrix multiplies are where recomputation
shows, and they dominate every model here — a scan's body costs its length times over, and a
`shard_map`'s body once per device along its manual axes. The pipeline executor's switches
are counted by what a valid schedule guarantees: over all its (tick, stage) cells, every
branch but the idle one (no work) runs exactly once per microbatch.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core


def dot_flops(jaxpr: Any, *, ticks: int | None = None, microbatches: int = 1) -> float:
    """Total FLOPs of the matrix multiplies in `jaxpr` (a Jaxpr or ClosedJaxpr) over all
    devices. `ticks`: the length of the pipeline executor's tick loop, whose switches are
    counted once per microbatch per branch (None: the step has no pipeline)."""
    return _walk(_open(jaxpr), 1.0, ticks, microbatches, in_ticks=False)


def _open(jaxpr: Any) -> core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr


def _walk(jaxpr: core.Jaxpr, times: float, ticks: int | None, microbatches: int, *, in_ticks: bool) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lhs_contracting, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            contracted = math.prod(lhs[d] for d in lhs_contracting)
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
        elif name == "scan":
            length = params["length"]
            tick_loop = ticks is not None and length == ticks and not in_ticks
            total += _walk(_open(params["jaxpr"]), times * length, ticks, microbatches, in_ticks=tick_loop)
        elif name == "shard_map":
            devices = math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])
            total += _walk(_open(params["jaxpr"]), times * devices, ticks, microbatches, in_ticks=in_ticks)
        elif name == "cond":
            costs = [_walk(_open(b), 1.0, ticks, microbatches, in_ticks=False) for b in params["branches"]]
            if in_ticks:
                # `times` is ticks x devices here; the branches together run once per microbatch.
                assert ticks is not None
                total += sum(costs) * microbatches
            else:
                total += times * max(costs)
        elif name == "while":
            raise ValueError("a while loop's trip count is not in the jaxpr: count it another way")
        else:
            for value in params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
                        total += _walk(_open(sub), times, ticks, microbatches, in_ticks=in_ticks)
    return total
