"""The plan as data, rendered as text for people and JSON for tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslc.layers.inputs import UNPACKED, Packing
from dslc.plan.communication import Transfer
from dslc.plan.experts import ExpertLayer
from dslc.plan.flops import Flops
from dslc.plan.memory import Memory
from dslc.plan.padding import LogitsPadding, Padding
from dslc.plan.step_time import Hardware, StepTime

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class PipelineFigures:
    """The pipeline's figures in a plan: its schedule and sizes, its bubble (measured on the
    schedule's table, and in closed form where there is one) and the most chunk inputs a
    stage holds at once."""

    schedule: str
    stages: int
    microbatches: int
    virtual: int
    bubble_fraction: float
    theoretical_bubble: float | None  # None: the schedule has no closed form (v-half, a table from a file)
    peak_in_flight: int  # chunk inputs, on the busiest stage


@dataclass(frozen=True, slots=True)
class Measured:
    """What XLA's memory analysis of the compiled steps says, bytes per device (arguments +
    outputs + temporaries - aliased): filled in by `dslc plan --xla`, never by the planner."""

    grads_step: int
    train_step: int


@dataclass(frozen=True, slots=True)
class Plan:
    """What one training step of a checked program needs, per device, before anything runs."""

    model: str
    mesh: tuple[tuple[str, int], ...]
    parameters: int
    memory: Memory
    communication: tuple[Transfer, ...]
    flops: Flops
    pipeline: PipelineFigures | None
    device_memory: int | None
    warnings: tuple[str, ...]
    experts: tuple[ExpertLayer, ...] = ()
    measured: Measured | None = None
    step_time: StepTime | None = None  # estimated on `hardware`
    hardware: Hardware | None = None
    across_nodes: tuple[str, ...] = ()  # the axes whose groups the step time costs between nodes
    nodes_declared: bool = False  # whether the spec says which (`across N nodes`), or Megatron's layout does
    padding: tuple[Padding, ...] = ()  # vocabularies padded to split evenly
    logits_padding: LogitsPadding | None = None
    packing: Packing = UNPACKED  # documents packed into sequences
    packing_bytes: int = 0  # the document ids and the loss mask, per device (among the inputs)

    @property
    def devices(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    def to_json(self) -> dict[str, Any]:
        m = self.memory
        by_kind: dict[str, int] = {}
        by_axis: dict[str, int] = {}
        for t in self.communication:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
            axes = ",".join(t.axes)
            by_axis[axes] = by_axis.get(axes, 0) + t.bytes
        return {
            "model": self.model,
            "mesh": dict(self.mesh),
            "devices": self.devices,
            "parameters": self.parameters,
            "memory": {
                "params": m.params,
                "grads": m.grads,
                "grad_accumulator": m.grad_accumulator,
                "optimizer": m.optimizer,
                "inputs": m.inputs,
                "activations": m.activations,
                "temporaries": m.temporaries,
                "update": m.update,
                "grads_step": m.grads_step,
                "total": m.total,
                "details": [{"what": what, "bytes": size} for what, size in m.details],
            },
            "communication": {
                "transfers": [
                    {
                        "kind": t.kind,
                        "axes": list(t.axes),
                        "phase": t.phase,
                        "bytes": t.bytes,
                        "count": t.count,
                        "hideable": t.hideable,
                    }
                    for t in self.communication
                ],
                "by_kind": by_kind,
                "by_axis": by_axis,
                "total": sum(t.bytes for t in self.communication),
            },
            "flops": {
                "forward": self.flops.forward,
                "backward": self.flops.backward,
                "recompute": self.flops.recompute,
                "pipeline_recompute": self.flops.pipeline_recompute,
                "model": self.flops.model,
                "total": self.flops.total,
                "per_device": self.flops.total // self.devices,
            },
            "pipeline": None
            if self.pipeline is None
            else {
                "schedule": self.pipeline.schedule,
                "stages": self.pipeline.stages,
                "microbatches": self.pipeline.microbatches,
                "virtual": self.pipeline.virtual,
                "bubble_fraction": self.pipeline.bubble_fraction,
                "theoretical_bubble": self.pipeline.theoretical_bubble,
                "peak_in_flight": self.pipeline.peak_in_flight,
            },
            "experts": [
                {
                    "path": e.path,
                    "experts": e.experts,
                    "expert_axes": list(e.expert_axes),
                    "experts_per_device": e.experts_per_device,
                    "tokens_per_group": e.tokens_per_group,
                    "slots": e.slots,
                    "dropless_rows_worst": e.rows_worst,
                    "dropless_rows_even": e.rows_even,
                    "exchange": e.exchange,
                    "parameter_bytes": e.parameter_bytes,
                    "exchange_bytes": e.exchange_bytes,
                    "copies": e.copies,
                }
                for e in self.experts
            ],
            "xla": None
            if self.measured is None
            else {
                "grads_step": self.measured.grads_step,
                "train_step": self.measured.train_step,
                "grads_step_ratio": m.grads_step / self.measured.grads_step,
                "train_step_ratio": m.total / self.measured.train_step,
            },
            "step_time": None
            if self.step_time is None or self.hardware is None
            else {
                "compute_s": self.step_time.compute,
                "communication_s": self.step_time.communication,
                "hidden_communication_s": self.step_time.hidden,
                "bubble_s": self.step_time.bubble,
                "total_s": self.step_time.total,
                "hardware": self.hardware.to_json(),
                "across_nodes": list(self.across_nodes),
                "nodes_declared": self.nodes_declared,
            },
            "padding": {
                "arrays": [
                    {
                        "weight": p.weight,
                        "declared": list(p.declared),
                        "stored": list(p.stored),
                        "axes": list(p.axes),
                        "parameters": p.parameters,
                        "bytes_per_device": p.bytes,
                    }
                    for p in self.padding
                ],
                "logits": None
                if self.logits_padding is None
                else {
                    "classes": self.logits_padding.classes,
                    "width": self.logits_padding.width,
                    "flops": self.logits_padding.flops,
                },
            },
            "packing": {
                "segments": self.packing.segments,
                "readers": list(self.packing.readers),
                "mask": self.packing.mask,
                "bytes_per_device": self.packing_bytes,
            },
            "device_memory": self.device_memory,
            "fits": None if self.device_memory is None else m.total <= self.device_memory,
            "warnings": list(self.warnings),
        }

    def to_text(self) -> str:
        m = self.memory
        mesh = "x".join(str(s) for _, s in self.mesh) + " (" + ", ".join(n for n, _ in self.mesh) + ")"
        lines = [f"plan for {self.model} on mesh {mesh}, {self.devices} devices, {self.parameters:,} parameters", ""]
        lines.append("memory per device")
        rows = [
            ("parameters", m.params),
            ("gradients", m.grads),
            ("gradient accumulators", m.grad_accumulator),
            ("optimizer state", m.optimizer),
            ("inputs", m.inputs),
            ("activations", m.activations),
            ("temporaries", m.temporaries),
            ("optimizer update", m.update),
        ]
        if m.random_bits:  # planned for XLA's CPU backend (`dslc.plan.memory.cpu_random_bits`)
            rows.append(("dropout's random bits", m.random_bits))
        if m.reused:  # planned for XLA's CPU backend (`dslc.plan.memory.cpu_widening`)
            rows.append(("less, in donated buffers", m.reused))
        lines += [f"  {name:<24}{format_bytes(size):>12}" for name, size in rows]
        lines.append(f"  {'total':<24}{format_bytes(m.total):>12}")
        lines += [f"    {format_bytes(size):>10}  {what}" for what, size in m.details]
        if self.measured is not None:
            lines += ["", "compiled by XLA on this machine (memory analysis, per device)"]
            lines += [
                f"  {name:<16}planned {format_bytes(planned):>12}   XLA {format_bytes(measured):>12}"
                f"   planned / XLA {planned / measured:.3f}"
                for name, planned, measured in (
                    ("gradient step", m.grads_step, self.measured.grads_step),
                    ("training step", m.total, self.measured.train_step),
                )
            ]
        lines += ["", "communication per device per step (ring algorithms)"]
        lines += [
            f"  {t.kind:<20}{','.join(t.axes):<14}{t.phase:<11}{format_bytes(t.bytes):>12}  x{t.count}"
            + ("  (can run under the compute)" if t.hideable else "")
            for t in self.communication
        ] or ["  none"]
        lines.append(f"  {'total':<45}{format_bytes(sum(t.bytes for t in self.communication)):>12}")
        f = self.flops
        lines += [
            "",
            "FLOPs per step (whole mesh)",
            f"  forward {f.forward:.4g}, backward {f.backward:.4g}, recompute {f.recompute:.4g}"
            + (f", pipeline recompute {f.pipeline_recompute:.4g}" if f.pipeline_recompute else ""),
            f"  total {f.total:.4g} ({f.total / self.devices:.4g} per device)",
        ]
        if self.experts:
            lines += ["", "experts per device, for each copy of a layer (a routing group is one sequence)"]
            lines += [
                f"  {e.path}{f' (x{e.copies})' if e.copies > 1 else ''}: {e.experts_per_device} of {e.experts} experts"
                + (f" (split over {','.join(e.expert_axes)})" if e.expert_axes else "")
                + f", {format_bytes(e.parameter_bytes)}; "
                + (
                    f"dropless: {e.rows_worst} rows buffered per {e.tokens_per_group} tokens "
                    f"(the worst case; {e.rows_even} when routing is even); "
                    if e.rows_worst
                    else f"{e.slots} slots each per {e.tokens_per_group} tokens; "
                )
                + (f"{e.exchange} {format_bytes(e.exchange_bytes)} per step" if e.exchange != "none" else "no exchange")
                for e in self.experts
            ]
        if self.pipeline is not None:
            p = self.pipeline
            lines += [
                "",
                f"pipeline {p.schedule}: {p.stages} stages, {p.microbatches} microbatches"
                + (f", {p.virtual} chunks per stage" if p.virtual > 1 else "")
                + f"; bubble {p.bubble_fraction:.1%}"
                + (f" (closed form {p.theoretical_bubble:.1%})" if p.theoretical_bubble is not None else "")
                + f", at most {p.peak_in_flight} {'microbatches' if p.virtual == 1 else 'chunk-microbatches'}"
                " in flight per stage",
            ]
        if self.step_time is not None and self.hardware is not None:
            t = self.step_time
            lines += [
                "",
                f"estimated step time {format_seconds(t.total)}: compute {format_seconds(t.compute)}, "
                f"communication {format_seconds(t.communication)} exposed"
                + (f" (and {format_seconds(t.hidden)} under the compute)" if t.hidden else "")
                + f", bubble {format_seconds(t.bubble)}",
                f"  on {self.hardware.describe()} (docs/plan.md; --device-flops and the other flags of "
                "--mesh auto change them)",
                f"  across nodes: {', '.join(self.across_nodes) or 'no axis'}"
                + (" (as the spec's mesh declares)" if self.nodes_declared else " (Megatron's layout, by node size)"),
            ]
        lines += self._padding_text()
        if self.packing.describe():
            lines += ["", self.packing.describe(), f"  their inputs: {format_bytes(self.packing_bytes)} per device"]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"

    def _padding_text(self) -> list[str]:
        if not self.padding:
            return []
        lines = ["", "vocabulary padded to split evenly (the padding is zero, masked out of the loss, never exported)"]
        for p in self.padding:
            shapes = f"[{', '.join(map(str, p.declared))}] -> [{', '.join(map(str, p.stored))}]"
            # Padding to the next size the split divides costs no memory: an uneven split's
            # largest piece is as large.
            cost = f"+{format_bytes(p.bytes)} of training state per device" if p.bytes else "no more memory per device"
            lines.append(f"  {p.weight} {shapes} over {','.join(p.axes)}: +{p.parameters:,} parameters, {cost}")
        if self.logits_padding is not None:
            lp = self.logits_padding
            share = lp.flops / self.flops.total if self.flops.total else 0.0
            lines.append(
                f"  logits {lp.classes} -> {lp.width} wide, masked out of the loss: +{lp.flops:.4g} FLOPs per step "
                f"({share:.3%})"
            )
        return lines


def format_bytes(n: int) -> str:
    """Bytes in binary units, as people read them."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_seconds(s: float) -> str:
    """A duration in the unit people read it in."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"
