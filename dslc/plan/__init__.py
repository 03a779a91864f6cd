"""The planner: memory, communication, pipeline bubble and FLOPs of a checked program.

Front-end code: it reads only the IR, the layer rules and the schedule tables, and imports
no accelerator stack, so `dslc plan` answers before anything is compiled or allocated.
"""

from __future__ import annotations

from dslc.ir.nodes import Program, all_layers, parameter_count
from dslc.ir.schedule import pipeline_figures, schedule_of
from dslc.layers import RULES
from dslc.layers.inputs import packing
from dslc.plan.communication import Transfer, communication
from dslc.plan.experts import ExpertLayer, experts
from dslc.plan.flops import Flops, busiest_stage_flops, flops
from dslc.plan.memory import Memory, memory
from dslc.plan.padding import logits_padding, paddings
from dslc.plan.report import PipelineFigures, Plan, format_bytes
from dslc.plan.roles import read_roles
from dslc.plan.step_time import Hardware, StepTime, node_local_axes, step_time

__all__ = ["ExpertLayer", "Flops", "Hardware", "Memory", "PipelineFigures", "Plan", "StepTime", "Transfer", "plan"]


def plan(
    program: Program, device_memory: int | None = None, hardware: Hardware | None = None, backend: str | None = None
) -> Plan:
    """The plan of one training step of `program`; `device_memory` (bytes per device), when
    given, is compared with the total; the step time is estimated on `hardware` (its
    defaults when None), with the cost model `--mesh auto` ranks plans by. `backend`: the
    XLA backend the step is compiled for, when the plan is held against it ("cpu" adds what
    XLA's CPU backend alone holds: `dslc.plan.memory.cpu_widening`)."""
    hardware = hardware or Hardware()
    mem = memory(program, backend)
    transfers = tuple(communication(program))
    warnings = []
    if device_memory is not None and mem.total > device_memory:
        warnings.append(
            f"each device needs {format_bytes(mem.total)}, more than the {format_bytes(device_memory)} "
            "given by --device-memory"
        )
    rings = [layer.path for layer in all_layers(program) if RULES[layer.kind].context_axes(layer, program.mesh)]
    if rings:
        which = f"`{rings[0]}` and {len(rings) - 1} more are" if len(rings) > 1 else f"`{rings[0]}` is"
        warnings.append(
            f"{which} ring attention, whose memory this plan undercounts at larger sizes "
            "(long_context with 256 and 512 tokens per sequence: 0.85 and 0.88 of XLA's figure; docs/plan.md); "
            "leave that much headroom, or compare with `dslc plan --xla`"
        )
    pipe = _pipeline(program)
    order = read_roles(program).innermost_first(program.mesh.shape)
    intra = node_local_axes(program.mesh, order, hardware.node_size)
    bubble = pipe.bubble_fraction if pipe is not None else 0.0
    estimate = step_time(busiest_stage_flops(program), transfers, bubble, intra, hardware)
    packed = packing(program)
    return Plan(
        model=program.name,
        mesh=tuple(zip(program.mesh.names, program.mesh.shape, strict=True)),
        parameters=parameter_count(program),
        memory=mem,
        communication=transfers,
        flops=flops(program),
        pipeline=pipe,
        device_memory=device_memory,
        warnings=tuple(warnings),
        experts=experts(program),
        step_time=estimate,
        hardware=hardware,
        across_nodes=tuple(a for a in program.mesh.names if a not in intra),
        nodes_declared=program.mesh.nodes > 1,
        padding=paddings(program),
        logits_padding=logits_padding(program),
        packing=packed,
        packing_bytes=sum(
            i.type.local_nbytes(program.mesh) for i in program.inputs if i.name in (packed.segments, packed.mask)
        ),
    )


def _pipeline(program: Program) -> PipelineFigures | None:
    p = program.pipeline
    if p is None:
        return None
    stages = program.stages
    figures = pipeline_figures(program)
    if figures is None:  # one stage: nothing to schedule
        return None
    return PipelineFigures(
        schedule=p.schedule,
        stages=stages,
        microbatches=p.microbatches,
        virtual=p.virtual,
        bubble_fraction=figures.bubble_fraction,
        theoretical_bubble=schedule_of(program).theoretical_bubble(),
        peak_in_flight=figures.peak_in_flight,
    )
