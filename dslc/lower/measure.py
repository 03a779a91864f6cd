"""`dslc plan --mesh auto --measure K`: the best K plans compiled here, XLA's memory beside the plan's.

The cost model ranks plans on paper; this compiles the training step of each of the first K
that fit (the spec rewritten to the plan's mesh and pipeline settings, as the report prints
them) for this machine's backend, and sets XLA's memory analysis per device beside the
plan's total for the same backend (on a CPU, with the f32 copies only its backend keeps of a
16-bit step, as `dslc plan --xla` does). A CPU-only machine simulates the devices, so only
memory is measured, not time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.frontend import Overrides
from dslc.lower.devices import request_host_devices
from dslc.plan.report import format_bytes
from dslc.search.report import AutoPlan, Candidate
from dslc.syntax import ast

# Beyond this ratio either way, the report says that measurement and plan disagree.
AGREEMENT = 0.10


@dataclass(frozen=True, slots=True)
class Measured:
    rank: int  # 1-based, in the search's order by estimated step time
    candidate: Candidate
    planned: int  # bytes per device, planned for this backend
    xla: int  # bytes per device, XLA's memory analysis of the compiled training step

    @property
    def ratio(self) -> float:
        return self.xla / self.planned


def measure(
    found: AutoPlan, text: str, module: ast.Module, overrides: Overrides, count: int
) -> tuple[str, list[Measured]]:
    """The backend, and the first `count` accepted candidates of `found` compiled and measured."""
    request_host_devices(found.devices)  # before jax starts: a CPU-only machine simulates them
    import jax

    import dslc
    from dslc.plan import plan

    backend = jax.default_backend()
    chosen = [(i + 1, c) for i, c in enumerate(found.ranked) if c.accepted][:count]
    measured = []
    for rank, candidate in chosen:
        program = dslc.compile(with_section(text, module, found.section(candidate)), candidate.mesh, overrides)
        planned = plan(program.ir, backend=backend).memory.total
        measured.append(Measured(rank, candidate, planned, program.compiled_memory("train").total))
    return backend, measured


def with_section(text: str, module: ast.Module, section: str | None) -> str:
    """The spec's text with its `pipeline` section replaced by `section` (unchanged for None)."""
    pipelines = [item for item in module.items if isinstance(item, ast.PipelineDef)]
    if section is None or not pipelines:
        return text
    span = pipelines[0].span
    lines = text.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: span.line - 1]) + span.column - 1
    end = sum(len(line) for line in lines[: span.end_line - 1]) + span.end_column - 1
    return text[:start] + section + text[end:]


def report(found: AutoPlan, backend: str, measured: list[Measured]) -> str:
    """The measurements as text, and where they and the plan disagree."""
    lines = [
        "",
        f"measured: the training step of the {len(measured)} fastest plans that fit, compiled for {backend} here "
        f"(XLA's memory analysis per device{'; the devices simulated, so no timing' if backend == 'cpu' else ''})",
        f"  {'#':>3}  {'mesh':<12}{'schedule':<22}{'micro':>6}{'planned':>13}{'XLA':>13}{'XLA/plan':>10}",
    ]
    for m in measured:
        c = m.candidate
        staged = found.pipelined(c)
        schedule = f"{c.schedule}" + (f" v{c.virtual}" if c.virtual > 1 else "") if staged else "-"
        lines.append(
            f"  {m.rank:>3}  {found.mesh_text(c.mesh):<12}{schedule:<22}{c.microbatches if staged else '-':>6}"
            f"{format_bytes(m.planned):>13}{format_bytes(m.xla):>13}{m.ratio:>10.3f}"
        )
    off = [m for m in measured if abs(m.ratio - 1) > AGREEMENT]
    for m in off:
        lines.append(
            f"  disagreement: #{m.rank} (mesh {found.mesh_text(m.candidate.mesh)}) XLA allocates {m.ratio:.2f}x "
            "the plan's memory"
        )
    over = [m for m in measured if m.xla > found.device_memory]
    for m in over:
        lines.append(
            f"  disagreement: #{m.rank} fits on paper but XLA needs {format_bytes(m.xla)}, over "
            f"{format_bytes(found.device_memory)} per device"
        )
    by_xla = sorted(measured, key=lambda m: m.xla)
    by_plan = sorted(measured, key=lambda m: m.planned)
    if [m.rank for m in by_xla] != [m.rank for m in by_plan]:
        lines.append(
            "  disagreement: by XLA's memory the order is "
            + ", ".join(f"#{m.rank}" for m in by_xla)
            + "; by the plan's, "
            + ", ".join(f"#{m.rank}" for m in by_plan)
        )
    if not off and not over and by_xla == by_plan:
        lines.append(f"  measurement and plan agree within {AGREEMENT:.0%} and in their order")
    return "\n".join(lines) + "\n"
