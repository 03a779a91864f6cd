"""The schedule's own constraints, as the schedule generator states them, and what the
executor can run. A table read from a file was checked as it was read."""

from __future__ import annotations

from dslc.diagnostics import Diagnostics, Label
from dslc.ir.nodes import Program, all_layers
from dslc.ir.schedule import BuiltInSchedule, schedule_of
from dslc.layers import RULES
from dslc.schedules import KINDS, MAX_ACTIONS, ScheduleError, check_arguments, table_actions
from dslc.schedules.figures import closed_form


def check_schedule(program: Program, diags: Diagnostics) -> None:
    """The kind's constraints on its arguments (E022), without building its table; and a
    table too large to build where the planner has no closed form for it (E031)."""
    p = program.pipeline
    if p is None or not isinstance(schedule_of(program), BuiltInSchedule) or p.schedule not in KINDS:
        return
    stages = program.stages
    try:
        kind, virtual = check_arguments(p.schedule, stages, p.microbatches, p.virtual)
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
        return
    actions = table_actions(kind, stages, p.microbatches, virtual)
    if program.pipelined and not closed_form(kind, stages) and actions > MAX_ACTIONS:
        diags.error(
            "E031",
            f"the {kind} table for {stages} stages, {p.microbatches:,} microbatches has {actions:,} actions, "
            f"more than the {MAX_ACTIONS:,} dslc builds, and {kind} on {stages} stages has no closed form to plan by",
            p.span,
            help="use fewer microbatches (past 4 per stage the bubble hardly shrinks), or zb-v, planned in closed form",
        )


def check_executor(program: Program, diags: Diagnostics) -> None:
    """What dslc plans and draws but the executor cannot run (E031): a table too large to
    build (the executor runs the whole table)."""
    p = program.pipeline
    if p is None or not program.pipelined:
        return
    stages = program.stages
    try:
        actions = schedule_of(program).actions()
    except ScheduleError:
        return  # check_schedule reported it
    if actions > MAX_ACTIONS:
        diags.error(
            "E031",
            f"the executor runs the whole table, and {p.schedule} for {stages} stages, {p.microbatches:,} "
            f"microbatches has {actions:,} actions, more than the {MAX_ACTIONS:,} dslc builds",
            p.span,
            help="`dslc plan` plans it in closed form; to run it, use fewer microbatches "
            "(past 4 per stage the bubble hardly shrinks)",
        )
        return


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
    if p is None or program.stages * p.virtual == 1:
        return
    for stream in program.streams:
        # The executor hands each chunk the one activation of `forward`; a stream would have
        # to travel to every stage whose layers read it, besides.
        diags.error(
            "E029",
            f"stream `{stream.path}` is a second activation, and the pipeline hands each stage only the "
            "activation of `forward`, not the streams its layers read",
            stream.span,
            labels=(Label(p.span, f"pipelined over `{p.axis}` here"),),
            help="drop the pipeline from a model with streams (split the batch, the heads or the weights instead)",
        )
    for layer in all_layers(program):
        refusal = RULES[layer.kind].pipeline_refusal(layer)
        if refusal is not None:
            diags.error(
                "E029",
                f"`{layer.path}` {refusal}",
                layer.span,
                labels=(Label(p.span, f"pipelined over `{p.axis}` here"),),
                help="keep the sequence whole in pipelined models (split the batch instead), or drop the pipeline",
            )
