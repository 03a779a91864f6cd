"""The layout space: every spec at test size, under every way of laying out its training
state and its step, on meshes that split every axis.

A layout (ZeRO stage or FSDP, gradient accumulation, pipeline schedule) and a mesh are memory
and scheduling decisions: none may change a number. `Combination` names one point of the
space, `space()` lists them all, `check_combination` compiles one and holds its loss, every
gradient and one training step's figures to the spec's single-device reference
(tests/reference.py), computed once per spec on the spec's own weights and batch.

The whole space is a few hundred compilations: `pytest tests/lower/test_layouts.py --layouts
all` checks it (tests/lower/test_layouts.py says how long it takes); the suite checks a
seeded sample of it.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.ir.state import zero_axes
from dslc.schedules import KINDS as SCHEDULE_KINDS
from tests import reference
from tests.conftest import SPECS as SPEC_DIR
from tests.conftest import TEST_SPECS
from tests.tolerances import BF16, F32, Tolerance, grads_error, relative_error

# ---- the specs, at test size -------------------------------------------------------------------


@dataclass(frozen=True)
class SpecAtTestSize:
    """A spec file and what brings it to a size that compiles in seconds: constants (`--set`)
    and literal edits of its text (a pipeline's microbatches are not a constant)."""

    path: Path
    overrides: Mapping[str, Any] = field(default_factory=dict)
    edits: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.path.stem

    def text(self) -> str:
        text = self.path.read_text()
        for old, new in self.edits:
            assert text.count(old) == 1, (self.name, old)
            text = text.replace(old, new)
        return text


# Specs whose declared sizes take minutes to compile here, or more memory than this machine
# has, and what shrinks them; the layout (axes, shardings, pipeline, settings) is untouched.
# Pipelined specs get batches that 2 accumulation steps x their microbatches x 4 data shards
# divide, and layers that two chunks per stage (the V schedules) divide.
TEST_SIZES: dict[str, dict[str, Any]] = {
    "seed_tp_layer": {"overrides": {"hidden": 64, "heads": 4, "ffn": 128, "seq": 16, "batch": 8}},
    "seed_hybrid_3d": {"overrides": {"layers": 4, "seq": 64, "hidden": 128, "batch": 64}},
    "seed_mlp_pipeline": {"overrides": {"batch": 64}},
    "gpt_small": {"overrides": {"batch": 32}},
    "gpt2": {"overrides": {"vocab": 257, "positions": 64, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 32}},
    "gpt_neox": {"overrides": {"vocab": 256, "d": 64, "heads": 4, "layers": 4, "seq": 32, "batch": 32}},
    "llama": {
        "overrides": {"vocab": 256, "d": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "layers": 4, "seq": 32, "batch": 32}
    },
    "gemma2": {
        "overrides": {
            "vocab": 256,
            "d": 64,
            "heads": 4,
            "kv_heads": 2,
            "head_dim": 32,
            "ffn": 128,
            "layers": 4,
            "window": 8,
            "seq": 32,
            "batch": 32,
        }
    },
    # Flan-T5-small's encoder-decoder, small: sources twice as long as the targets, a few
    # distance buckets so that far keys share the last one.
    "t5": {
        "overrides": {
            "vocab": 256,
            "d": 64,
            "heads": 4,
            "head_dim": 16,
            "ffn": 128,
            "layers": 2,
            "seq": 32,
            "target_seq": 16,
            "batch": 32,
            "buckets": 8,
            "max_distance": 16,
        }
    },
    # The mixtures of experts in f32: in bf16 a choice of experts flips wherever two of a
    # token's probabilities round apart differently on two layouts, and moves a token's whole
    # gradient to another expert (qwen3_moe, top 2 of 8: 0.27 between 1x1x1 and 2x2x2, and as
    # much against the reference; with every expert chosen 0.10; in f32 2e-6). Their 16-bit
    # numerics are held by tests/codegen's golden figures.
    "mixtral": {"overrides": {"batch": 32}, "edits": (("compute_dtype bf16", "compute_dtype f32"),)},
    "qwen3_moe": {"overrides": {"batch": 32}, "edits": (("compute_dtype bf16", "compute_dtype f32"),)},
    "qwen2_moe": {"overrides": {"batch": 32}, "edits": (("compute_dtype bf16", "compute_dtype f32"),)},
    "gpt3_175b": {
        "overrides": {"vocab": 256, "d": 64, "heads": 4, "seq": 32, "batch": 32, "n_layers": 8},
        "edits": (("microbatches 192", "microbatches 4"),),
    },
    "counted_pipeline": {
        "edits": (
            ("tokens: i32[8 @ data, 8]", "tokens: i32[16 @ data, 8]"),
            ("targets: i32[8 @ data, 8]", "targets: i32[16 @ data, 8]"),
        )
    },
    "zero3_mlp": {
        "overrides": {"d": 64},
        "edits": (("x: f32[8 @ data", "x: f32[16 @ data"), ("y: f32[8 @ data", "y: f32[16 @ data")),
    },
}


@functools.cache
def all_specs() -> dict[str, SpecAtTestSize]:
    """Every spec in specs/ and tests/specs/, by name, at test size."""
    out = {}
    for path in sorted([*SPEC_DIR.glob("*.par"), *TEST_SPECS.glob("*.par")]):
        sizes = TEST_SIZES.get(path.stem, {})
        out[path.stem] = SpecAtTestSize(path, sizes.get("overrides", {}), sizes.get("edits", ()))
    return out


# ---- layouts -----------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Layout:
    """How a step lays out its training state and its work: a ZeRO stage or FSDP over the
    batch's axes, accumulation steps, and (pipelined specs) a schedule other than the spec's."""

    state: str  # "zero0" ... "zero3", or "fsdp"
    accumulate: int = 1
    schedule: str | None = None

    @property
    def id(self) -> str:
        parts = [self.state, f"acc{self.accumulate}"]
        return "-".join([*parts, self.schedule] if self.schedule else parts)

    @classmethod
    def parse(cls, text: str) -> Layout:
        state, acc, *schedule = text.split("-", 2)
        return cls(state, int(acc.removeprefix("acc")), schedule[0] if schedule else None)


STATES = ("zero0", "zero1", "zero2", "zero3", "fsdp")
GRID = tuple(Layout(state, acc) for state in STATES for acc in (1, 2))


def batch_axes_of(program: ir.Program) -> tuple[str, ...]:
    """The axes FSDP splits over in the space: the batch's, or where the batch is not split
    (attention_only), the first mesh axis."""
    return zero_axes(program) or program.mesh.names[:1]


def with_layout(text: str, layout: Layout, batch_axes: tuple[str, ...]) -> str:
    """The spec's text with its `train` section saying `layout` (any ZeRO, FSDP or
    accumulation setting it had replaced; FSDP over the batch's axes), and its pipeline two
    chunks per stage for an interleaved schedule."""
    settings = [f"accumulate {layout.accumulate}"]
    if layout.state == "fsdp":
        settings.append("fsdp " + ", ".join(batch_axes))
    else:
        settings.append(f"zero {layout.state.removeprefix('zero')}")
    if layout.schedule == "interleaved-1f1b" and not re.search(r"\bvirtual\b", text):
        text = re.sub(r"(\bpipeline\s+\w+\s*\{)", r"\1\n  virtual 2", text, count=1)
    found = re.search(r"\btrain\s*\{([^}]*)\}", text)
    if found is None:
        return text.rstrip("\n") + "\ntrain {\n  " + "\n  ".join(settings) + "\n}\n"
    kept = re.sub(r"\b(zero|accumulate)\s+\w+|\bfsdp\s+\w+(\s*,\s*\w+)*", "", found.group(1))
    body = "\n  " + "\n  ".join(settings) + "\n" + kept
    return text[: found.start(1)] + body + text[found.end(1) :]


# ---- meshes ------------------------------------------------------------------------------------

MAX_DEVICES = 16  # the suite's simulated devices


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return sum(abs(math.log2(x / y)) for x, y in zip(a, b, strict=True))


@functools.cache
def meshes_of(name: str) -> tuple[str, ...]:
    """`pick_meshes` of the spec named."""
    return pick_meshes(all_specs()[name])


def pick_meshes(spec: SpecAtTestSize) -> tuple[str, ...]:
    """Two meshes on which the spec checks clean and every axis has two devices or more: the
    one nearest the spec's default, and the one farthest from that (so devices move between
    axes); fewer when fewer exist."""
    base = analyze(spec.text(), None, spec.overrides)
    if base.program is None:
        return ()
    default = base.program.mesh.shape
    legal = []
    for sizes in itertools.product((2, 3, 4, 8), repeat=len(default)):
        if math.prod(sizes) <= MAX_DEVICES and analyze(spec.text(), sizes, spec.overrides).ok:
            legal.append(sizes)
    if not legal:
        return ()
    first = min(legal, key=lambda s: (_distance(s, default), math.prod(s), s))
    rest = [s for s in legal if s != first]
    chosen = [first]
    if rest:
        chosen.append(max(rest, key=lambda s: (_distance(s, first), -math.prod(s), s)))
    return tuple("x".join(map(str, s)) for s in chosen)


# ---- the space ---------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Combination:
    spec: str
    layout: Layout
    mesh: str

    @property
    def id(self) -> str:
        return f"{self.spec}:{self.layout.id}:{self.mesh}"

    @classmethod
    def parse(cls, text: str) -> Combination:
        spec, layout, mesh = text.split(":")
        return cls(spec, Layout.parse(layout), mesh)


def layouts_for(spec: SpecAtTestSize, index: int) -> tuple[Layout, ...]:
    """The grid of ZeRO stages (and FSDP) by accumulation; a pipelined spec also runs every
    other schedule once, each under a layout of the grid that turns with the spec's index,
    so that across specs each schedule meets every stage."""
    base = analyze(spec.text(), None, spec.overrides)
    if base.program is None or base.program.pipeline is None:
        return GRID
    own = base.program.pipeline.schedule
    others = [k for k in SCHEDULE_KINDS if k != own]
    extra = tuple(
        Layout(GRID[(index + i) % len(GRID)].state, GRID[(index + i) % len(GRID)].accumulate, kind)
        for i, kind in enumerate(others)
    )
    return GRID + extra


@functools.cache
def space() -> tuple[Combination, ...]:
    """Every (spec, layout, mesh) of the space, in a fixed order."""
    out = []
    for index, (name, spec) in enumerate(all_specs().items()):
        meshes = meshes_of(name) or ("default",)
        for layout in layouts_for(spec, index):
            out.extend(Combination(name, layout, mesh) for mesh in meshes)
    return tuple(out)


# ---- checking one combination ------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """A spec's weights and batch (seed 0, from the first of its programs checked: every layout
    holds the same weights) and what the single-device reference computes on them."""

    weights: dict[str, np.ndarray]
    batch: dict[str, np.ndarray]
    reference: reference.Reference
    tolerance: Tolerance
    dropout: bool


BASES: dict[str, Base] = {}


def base_of(spec: str, program: Any, model: Any) -> Base:
    """The spec's base, made from `program` and its freshly initialised `model` the first time."""
    if spec not in BASES:
        weights = program.export_weights(model)
        batch = program.example_batch(0)
        BASES[spec] = Base(
            weights,
            batch,
            reference.evaluate(program.ir, weights, batch),
            BF16 if program.ir.train.compute_dtype == "bf16" else F32,
            any(layer.kind == "dropout" for layer in ir.all_layers(program.ir)),
        )
    return BASES[spec]


@dataclass(frozen=True)
class Outcome:
    """What one combination gave: refused by `dslc check` (its error codes), or its errors
    against the reference (norm-relative, tests/tolerances.py)."""

    refused: tuple[str, ...] = ()
    loss: float = 0.0
    grads: Mapping[str, float] = field(default_factory=dict)
    step_loss: float | None = None
    step_grad_norm: float | None = None
    stalls: tuple[str, ...] = ()  # collectives that would hang a pipelined step, not run

    @property
    def worst_grad(self) -> tuple[str, float]:
        name = max(self.grads, key=self.grads.__getitem__)
        return name, self.grads[name]


def _analysis_arguments(combination: Combination) -> tuple[str, str | None, dict[str, Any], str | None]:
    text, overrides, mesh, schedule = source_of(combination)
    return text, mesh, overrides, schedule


def source_of(combination: Combination) -> tuple[str, dict[str, Any], str | None, str | None]:
    """The spec text, constants, mesh and schedule a combination compiles."""
    spec = all_specs()[combination.spec]
    text = spec.text()
    plain = analyze(text, None, spec.overrides).program
    batch_axes = batch_axes_of(plain) if plain is not None else ()
    mesh = None if combination.mesh == "default" else combination.mesh
    return with_layout(text, combination.layout, batch_axes), dict(spec.overrides), mesh, combination.layout.schedule


def check_combination(combination: Combination, step: bool = True) -> tuple[Outcome, Tolerance]:
    """Compile one combination and measure it against its spec's reference, and with `step`
    one training step too; a combination `dslc check` refuses is reported with its error
    codes, never run. Returns the outcome and the tolerance it is held to."""
    import jax

    import dslc

    text, overrides, mesh, schedule = source_of(combination)
    analysis = analyze(text, mesh, overrides, schedule)
    if not analysis.ok:
        return Outcome(refused=tuple(sorted({d.code for d in analysis.diagnostics if d.is_error}))), F32
    program = dslc.compile(text, mesh, overrides, schedule)
    if combination.spec in BASES:
        given = BASES[combination.spec]
        model = program.load(given.weights)
    else:
        model = program.init(0)
        given = base_of(combination.spec, program, model)
    if program.ir.pipelined:
        # A collective that waits for another stage's devices hangs the step (for 40 s, then
        # XLA's CPU backend aborts the process): found in the compiled program instead.
        stalls = stalling_collectives(program)
        if stalls:
            return Outcome(stalls=stalls), given.tolerance
    loss, grads = program.loss_and_grads(model, given.batch)
    want = given.reference
    assert want.loss is not None
    outcome = Outcome(loss=relative_error(loss, want.loss), grads=grads_error(grads, want.grads))
    if not step:
        return outcome, given.tolerance
    # One training step: its gradients as the update sees them (ZeRO's pieces), and the
    # parameters it writes back, where and as big as they are stored.
    state = program.init_optimizer(model)
    _, figures = program.train_step_with_metrics(model, state, given.batch, 0)
    for name, value in model.arrays().items():
        assert value.shape == program.module.PARAMETERS[name].shape, name
        assert bool(jax.numpy.isfinite(value).all()), name
    if given.dropout:  # the step trains with dropout on: its figures are not the reference's
        return outcome, given.tolerance
    norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in want.grads.values()))
    measured = Outcome(
        loss=outcome.loss,
        grads=outcome.grads,
        step_loss=relative_error(figures["loss"], want.loss),
        step_grad_norm=relative_error(figures["grad_norm"], norm),
    )
    return measured, given.tolerance


def measure(combination: Combination, step: bool) -> tuple[Outcome, Tolerance]:
    """`check_combination` in a test: one `dslc check` refuses is skipped, with its codes."""
    import pytest

    outcome, tolerance = check_combination(combination, step)
    if outcome.refused:
        pytest.skip(f"refused by dslc check: {', '.join(outcome.refused)}")
    return outcome, tolerance


def stalling_collectives(program: Any) -> tuple[str, ...]:
    """The collectives of a pipelined program's gradient step that would wait for another
    stage's devices inside the executor's branches (`dslc.lower.hlo.stalling`), in words."""
    from dslc.lower.hlo import collectives, stalling

    mesh = program.mesh
    found = collectives(program.lower("grads").compile().as_text())
    stalls = stalling(found, mesh.axis_names, tuple(mesh.shape.values()), program.ir.pipeline.axis)
    return tuple(f"{c.kind} over {c.groups} at {c.op_name}" for c in stalls)


def failures(outcome: Outcome, tolerance: Tolerance) -> list[str]:
    """What in an outcome exceeds the tolerance, in words (empty: all within it)."""
    out = [f"would hang: {stall}" for stall in outcome.stalls[:5]]
    if outcome.loss > tolerance.loss:
        out.append(f"loss {outcome.loss:.2e}")
    bad = sorted((e, n) for n, e in outcome.grads.items() if e > tolerance.grads)
    out.extend(f"{n} {e:.2e}" for e, n in reversed(bad[-5:]))
    if outcome.step_loss is not None and outcome.step_loss > tolerance.loss:
        out.append(f"training step's loss {outcome.step_loss:.2e}")
    if outcome.step_grad_norm is not None and outcome.step_grad_norm > tolerance.grads:
        out.append(f"training step's gradient norm {outcome.step_grad_norm:.2e}")
    return out


def sample(seed: int, count: int) -> list[Combination]:
    """`count` combinations of the space drawn with `seed`, at most one per spec, each one
    `dslc check` accepts."""
    import random

    rng = random.Random(seed)
    by_spec: dict[str, list[Combination]] = {}
    for c in space():
        by_spec.setdefault(c.spec, []).append(c)
    chosen = []
    for name in rng.sample(sorted(by_spec), len(by_spec)):
        accepted = [c for c in by_spec[name] if analyze(*_analysis_arguments(c)).ok]
        if accepted:
            chosen.append(rng.choice(accepted))
        if len(chosen) == count:
            break
    return sorted(chosen)


def iterate(ids: str) -> Iterator[Combination]:
    """The combinations a comma-separated list of ids names."""
    for text in ids.split(","):
        yield Combination.parse(text.strip())
