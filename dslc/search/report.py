"""The result of `dslc plan --mesh auto` as data, rendered as text for people and JSON for tools."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from dslc.plan.memory import Memory
from dslc.plan.report import format_bytes
from dslc.plan.step_time import Hardware, StepTime

# Candidates listed in the text report beyond those that fit (JSON lists every one).
SHOWN = 10


@dataclass(frozen=True, slots=True)
class Candidate:
    """One plan the search costed: mesh sizes (in the spec's axis order), schedule, microbatches."""

    mesh: tuple[int, ...]
    schedule: str | None  # None: the spec has no pipeline
    microbatches: int | None
    virtual: int
    time: StepTime | None  # None when the checker rejected the plan before it could be costed
    sent: int  # bytes one device sends per step (the busiest one)
    memory: int  # bytes per device; a lower bound when `memory_exact` is false
    memory_exact: bool
    fits: bool
    rejected: str | None = None  # the checker's first error

    @property
    def accepted(self) -> bool:
        return self.fits and self.rejected is None


@dataclass(frozen=True, slots=True)
class Excluded:
    """A mesh (with a virtual count) ruled out before its candidates were costed."""

    mesh: tuple[int, ...]
    virtual: int
    reason: str  # the checker's first error, or which part of the memory alone is too much
    memory: int | None  # that part's bytes per device, when memory is the reason


@dataclass(frozen=True, slots=True)
class AutoPlan:
    """What `dslc plan --mesh auto` found: the chosen plan, the candidates judged on the way to
    it, and what was ruled out before costing."""

    model: str
    axes: tuple[tuple[str, str], ...]  # (name, role) in the spec's order
    pipeline_axis: str | None
    devices: int
    device_memory: int
    hardware: Hardware
    chosen: Candidate | None
    memory: Memory | None  # the chosen plan's memory, part by part
    closest: tuple[tuple[int, ...], int, bool] | None  # when nothing fits: the least memory found (mesh, bytes, exact)
    ranked: tuple[Candidate, ...]  # every candidate judged, fastest first; the chosen one among them
    excluded: tuple[Excluded, ...]
    elaborated: int
    costed: int
    across_nodes: tuple[str, ...] = ()  # the axes the spec declares `across N nodes`

    def mesh_text(self, sizes: tuple[int, ...]) -> str:
        return "x".join(map(str, sizes))

    def section(self, c: Candidate) -> str | None:
        """The `pipeline` section that gives the spec this plan's schedule."""
        if self.pipeline_axis is None or c.schedule is None or c.microbatches is None:
            return None
        extra = f"  virtual {c.virtual}" if c.virtual > 1 else ""
        return f"pipeline {self.pipeline_axis} {{ schedule {c.schedule}  microbatches {c.microbatches}{extra} }}"

    def verdict(self, c: Candidate) -> str:
        if c.rejected:
            return f"rejected: {c.rejected}"
        if not c.fits:
            needs = format_bytes(c.memory) if c.memory_exact else f"at least {format_bytes(c.memory)}"
            return f"does not fit ({needs} > {format_bytes(self.device_memory)})"
        if c is self.chosen:
            return "chosen"
        if self.chosen is not None and self.chosen.time is not None and c.time is not None:
            return f"fits, {c.time.total / self.chosen.time.total - 1:.1%} slower"
        return "fits"

    # ---- JSON ---------------------------------------------------------------------------------------

    def _candidate_json(self, c: Candidate) -> dict[str, Any]:
        return {
            "mesh": dict(zip((a for a, _ in self.axes), c.mesh, strict=True)),
            "mesh_text": self.mesh_text(c.mesh),
            "schedule": c.schedule,
            "microbatches": c.microbatches,
            "virtual": c.virtual,
            "step_time": None
            if c.time is None
            else {
                "total": c.time.total,
                "compute": c.time.compute,
                "communication": c.time.communication,
                "hidden_communication": c.time.hidden,
                "bubble": c.time.bubble,
            },
            "sent": c.sent,
            "memory": c.memory,
            "memory_exact": c.memory_exact,
            "fits": c.fits,
            "rejected": c.rejected,
            "verdict": self.verdict(c),
            "pipeline_section": self.section(c),
        }

    def to_json(self) -> dict[str, Any]:
        chosen = None
        if self.chosen is not None:
            chosen = self._candidate_json(self.chosen)
            if self.memory is not None:
                m = self.memory
                chosen["memory_parts"] = {
                    "params": m.params,
                    "grads": m.grads,
                    "grad_accumulator": m.grad_accumulator,
                    "optimizer": m.optimizer,
                    "inputs": m.inputs,
                    "activations": m.activations,
                    "temporaries": m.temporaries,
                    "update": m.update,
                    "total": m.total,
                }
        closest = self.closest
        return {
            "model": self.model,
            "devices": self.devices,
            "device_memory": self.device_memory,
            "hardware": self.hardware.to_json(),
            "axes": [
                {"name": name, "role": role, "across_nodes": name in self.across_nodes} for name, role in self.axes
            ],
            "chosen": chosen,
            "candidates": [{"rank": i, **self._candidate_json(c)} for i, c in enumerate(self.ranked, 1)],
            "excluded": [
                {"mesh_text": self.mesh_text(e.mesh), "virtual": e.virtual, "reason": e.reason, "memory": e.memory}
                for e in self.excluded
            ],
            "closest": None
            if closest is None
            else {"mesh_text": self.mesh_text(closest[0]), "memory": closest[1], "memory_exact": closest[2]},
            "searched": {"elaborated": self.elaborated, "costed": self.costed, "judged": len(self.ranked)},
        }

    # ---- text ---------------------------------------------------------------------------------------

    def pipelined(self, c: Candidate) -> bool:
        """Whether the plan runs a pipeline (more than one chunk)."""
        if self.pipeline_axis is None:
            return False
        return c.mesh[[a for a, _ in self.axes].index(self.pipeline_axis)] * c.virtual > 1

    def describe(self, c: Candidate) -> str:
        named = ", ".join(f"{a}={s}" for (a, _), s in zip(self.axes, c.mesh, strict=True))
        text = f"mesh {self.mesh_text(c.mesh)} ({named})"
        if self.pipelined(c):
            text += f", {c.schedule}, {c.microbatches} microbatches"
            text += f", {c.virtual} chunks per stage" if c.virtual > 1 else ""
        elif self.pipeline_axis is not None:
            text += ", no pipeline"
        return text

    def to_text(self) -> str:
        lines = [
            f"auto plan for {self.model}: {self.devices} device{'s' * (self.devices != 1)} with "
            f"{format_bytes(self.device_memory)} each",
            f"cost model: {self.hardware.describe()}",
            "axes: "
            + ", ".join(
                f"{name} ({role}{'; across nodes, as the spec declares' if name in self.across_nodes else ''})"
                for name, role in self.axes
            ),
            "",
        ]
        c = self.chosen
        if c is not None and c.time is not None:
            t = c.time
            lines += [
                f"chosen: {self.describe(c)}",
                f"  step time  {_seconds(t.total)} = compute {_seconds(t.compute)}"
                f" + exposed communication {_seconds(t.communication)} + bubble {_seconds(t.bubble)}"
                + (f" ({_seconds(t.hidden)} of communication under the compute)" if t.hidden else ""),
                f"  memory     {format_bytes(c.memory)} of {format_bytes(self.device_memory)} per device",
            ]
            if self.memory is not None:
                m = self.memory
                parts = [
                    ("parameters", m.params),
                    ("gradients", m.grads),
                    ("accumulators", m.grad_accumulator),
                    ("optimizer", m.optimizer),
                    ("inputs", m.inputs),
                    ("activations", m.activations),
                    ("temporaries", m.temporaries),
                    ("optimizer update", m.update),
                ]
                lines.append("             " + ", ".join(f"{name} {format_bytes(b)}" for name, b in parts if b))
            section = self.section(c)
            if section:
                lines.append(f"  in the spec: {section}")
            faster = sum(1 for r in self.ranked if r is not c and r.time and r.time.total < t.total)
            lines.append(
                f"  why: the fastest of {self.costed} candidates costed that fits and passes the checker"
                + (f"; the {faster} faster ones judged do not" if faster else "")
            )
        elif self.closest is None:
            lines.append(f"no mesh of {self.devices} devices passes the checker")
        else:
            mesh, size, exact = self.closest
            lines += [
                f"no plan fits in {format_bytes(self.device_memory)} per device",
                f"  the closest plan found, on mesh {self.mesh_text(mesh)}, needs {'' if exact else 'at least '}"
                + format_bytes(size),
            ]
        if self.ranked:
            lines += ["", "candidates by estimated step time"]
            lines.append(
                f"  {'#':>3}  {'mesh':<12}{'schedule':<22}{'micro':>6}{'step':>11}{'compute':>11}"
                f"{'comm':>11}{'bubble':>11}{'memory':>13}  verdict"
            )
            shown = [i for i, r in enumerate(self.ranked) if i < SHOWN or r.accepted]
            for i in shown:
                r = self.ranked[i]
                staged = self.pipelined(r)
                schedule = f"{r.schedule}" + (f" v{r.virtual}" if r.virtual > 1 else "") if staged else "-"
                times = [r.time.total, r.time.compute, r.time.communication, r.time.bubble] if r.time else [None] * 4
                lines.append(
                    f"  {i + 1:>3}  {self.mesh_text(r.mesh):<12}{schedule:<22}"
                    f"{r.microbatches if staged else '-':>6}"
                    + "".join(f"{_seconds(x) if x is not None else '-':>11}" for x in times)
                    + f"{format_bytes(r.memory):>13}  {self.verdict(r)}"
                )
            if len(shown) < len(self.ranked):
                lines.append(f"  ... {len(self.ranked) - len(shown)} more that do not fit (all in --format json)")
        if self.excluded:
            by_memory = [e for e in self.excluded if e.memory is not None]
            by_checker = Counter(e.reason.split(":", 1)[0] for e in self.excluded if e.memory is None)
            lines += ["", "ruled out before costing"]
            if by_memory:
                lines.append(
                    f"  {len(by_memory)} (mesh, virtual) pairs whose training state alone exceeds "
                    f"{format_bytes(self.device_memory)}"
                )
            if by_checker:
                counts = ", ".join(f"{code} x{n}" for code, n in sorted(by_checker.items()))
                lines.append(f"  {sum(by_checker.values())} (mesh, virtual) pairs the checker rejects ({counts})")
        return "\n".join(lines) + "\n"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1e-3 else f"{s * 1e6:.3g} us"
