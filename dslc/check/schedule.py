"""The schedule's own constraints, as the schedule generator states them."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics, Label
from dslc.ir.nodes import Program, all_layers
from dslc.layers import RULES
from dslc.schedules import KINDS, ScheduleError, build


def check_schedule(program: Program, diags: Diagnostics) -> None:
    p = program.pipeline
    if p is None or p.schedule not in KINDS:
        return
    stages = program.mesh.size((p.axis,))
    try:
        build(p.schedule, stages, p.microbatches, p.virtual)
    except ScheduleError as exc:
        # A schedule of one chunk per stage (`--schedule 1f1b` on an interleaved spec, say)
        # runs with `virtual 1`; the message itself points the other way, to interleaving.
        one_chunk = p.virtual != 1 and p.schedule != "interleaved-1f1b"
        diags.error(
            "E022",
            str(exc),
            p.span,
            notes=[f"{stages} stages (`{p.axis}`), {p.microbatches} microbatches, virtual {p.virtual}"],
            help=f"for {p.schedule}, set `virtual 1` in the pipeline section; written as a constant (`virtual v`), "
            "it can be changed from the command line with `--set v=1`"
            if one_chunk
            else None,
        )


def check_pipelined_kernels(program: Program, diags: Diagnostics) -> None:
    """Layers whose kernel enters its own `shard_map` (ring attention over a context axis)
    cannot yet run inside the pipeline's, which is manual over the stage axis.

    Two walls, both seen in jax 0.10.2: differentiating the nested `shard_map` fails to lower
    (the `custom_vjp` that recomputes the forward, as the mixture of experts does, gets past
    that); then the ring's `ppermute`s run inside the executor's per-stage `lax.switch`, and
    on CPU each becomes a collective-permute that waits for every device of the mesh, so the
    stages that take another branch never join it and the step deadlocks. The ring would have to pass
    its blocks outside the switch, as the executor's own sends do."""
    p = program.pipeline
    if p is None or program.mesh.size((p.axis,)) * p.virtual == 1:
        return
    for layer in all_layers(program):
        rule = RULES[layer.kind]
        if rule.kernel(dict(layer.attrs), layer.operand) == "ring_attention":
            diags.error(
                "E029",
                f"`{layer.path}` is context-parallel (ring) attention, which does not run inside a pipeline stage yet",
                layer.span,
                labels=(Label(p.span, f"pipelined over `{p.axis}` here"),),
                help="keep the sequence whole in pipelined models (split the batch instead), or drop the pipeline",
            )
