"""The front end as one call: source -> AST -> IR -> checked IR, with every diagnostic.

Imports no accelerator stack: `dslc check` answers in milliseconds.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dslc.check import check_program
from dslc.check.kernels import kernel_warnings
from dslc.diagnostics import NO_SPAN, Diagnostic, Diagnostics, Span, error, has_errors, render_text, sort_key
from dslc.elaborate import elaborate, read_constants
from dslc.ir.evaluate import ScalarValue
from dslc.ir.names import closest
from dslc.ir.nodes import Program
from dslc.schedules import KINDS as SCHEDULES
from dslc.syntax import ast
from dslc.syntax.format import value as format_value
from dslc.syntax.parser import parse
from dslc.syntax.source import Source, resolve

MeshArg = str | Sequence[int] | None

_MESH = re.compile(r"[0-9]+(x[0-9]+)*")
# More devices on one axis than any machine has; beyond it a size is a typo.
MAX_AXIS_SIZE = 1 << 20


def parse_mesh(mesh: MeshArg) -> tuple[int, ...] | None:
    """`"2x4x2"` (or a sequence of ints) to sizes; ValueError when malformed."""
    if mesh is None:
        return None
    if isinstance(mesh, str):
        text = mesh.strip().lower()
        if not _MESH.fullmatch(text):
            raise ValueError(f"--mesh must look like 2x4x2 (positive sizes joined by x), got {mesh!r}")
        sizes = tuple(int(p) for p in text.split("x"))
    else:
        sizes = tuple(mesh)
        if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ValueError(f"mesh sizes must be positive integers, got {mesh!r}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive, got {_mesh_text(mesh)}")
    if any(s > MAX_AXIS_SIZE for s in sizes):
        raise ValueError(
            f"mesh size {max(sizes):,} in {_mesh_text(mesh)} is more than any machine has "
            f"(at most {MAX_AXIS_SIZE:,} devices on an axis)"
        )
    return sizes


def _mesh_text(mesh: str | Sequence[int]) -> str:
    return repr(mesh) if isinstance(mesh, str) else "x".join(map(str, mesh))


@dataclass
class Analysis:
    """Everything the front end learned about one spec."""

    source: Source | None
    module: ast.Module | None
    program: Program | None
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.program is not None and not has_errors(self.diagnostics)


Overrides = Sequence[str] | Mapping[str, ScalarValue] | None

_INTEGER = re.compile(r"-?[0-9]{1,18}")
_NUMBER = re.compile(r"-?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?")


def parse_overrides(pairs: Overrides) -> dict[str, ScalarValue]:
    """`["layers=4", "eps=1e-6", "tied=true"]` (or a mapping) to constant overrides: integers,
    numbers with a fraction and booleans; ValueError when malformed."""
    if pairs is None:
        return {}
    if isinstance(pairs, Mapping):
        items = list(pairs.items())
    else:
        items = []
        for pair in pairs:
            name, sep, text = pair.partition("=")
            name, text = name.strip(), text.strip()
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"--set takes NAME=VALUE (an integer, a number or true/false), got {pair!r}")
            items.append((name, _scalar(text, pair)))
    out: dict[str, ScalarValue] = {}
    for name, value in items:
        if not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(
                f"constant `{name}` must be set to an integer, a finite number or a boolean, got {value!r}"
            )
        out[name] = value
    return out


def _scalar(text: str, pair: str) -> ScalarValue:
    if text in ("true", "false"):
        return text == "true"
    if _INTEGER.fullmatch(text):
        return int(text)
    if _NUMBER.fullmatch(text):
        return float(text)
    raise ValueError(f"--set takes NAME=VALUE (an integer, a number or true/false), got {pair!r}")


def check_overrides(module: ast.Module, values: dict[str, ScalarValue]) -> dict[str, ScalarValue]:
    """`values` against the constants the module declares: each must be defined, and set to a
    value of its kind (an integer for an integer, a number for a number with a fraction, where
    an integer is taken as that number, a boolean for a boolean). Returns them as declared."""
    decls = {item.name.text: item for item in module.items if isinstance(item, ast.ConstDecl)}
    for name in values:
        if name not in decls:
            known = ", ".join(sorted(decls)) or "none"
            raise ValueError(f"cannot set `{name}`: the spec defines no constant `{name}` (it has: {known})")
    # The values the spec writes, which say each constant's kind (one that does not evaluate is
    # reported by elaboration, unless it is set here, when its kind is whatever is given).
    declared = read_constants(module, {}, Diagnostics())
    out = dict(values)
    for name, value in values.items():
        if name not in declared:
            continue
        kind, given = _kind(declared[name]), _kind(value)
        if kind == "a number" and given == "an integer":
            out[name] = float(value)
        elif kind != given:
            decl = decls[name]
            raise ValueError(
                f"cannot set `{name}` to {_written(value)}: it is {kind} "
                f"(line {decl.span.line}: `const {name} = {format_value(decl.value)}`)"
            )
    return out


def _kind(value: ScalarValue) -> str:
    if isinstance(value, bool):
        return "a boolean (true or false)"
    return "an integer" if isinstance(value, int) else "a number"


def _written(value: ScalarValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def analyze(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Overrides = None,
    schedule: str | None = None,
    running: bool = True,
    backend: str | None = None,
) -> Analysis:
    """Parse, elaborate and check a spec. `overrides` sets constants (`{"layers": 4}`,
    `{"eps": 1e-6}`, `{"tied": True}`: each of the kind the spec declares it);
    `schedule` replaces the pipeline schedule the spec names: a kind, or the path of a table
    in JSON (`*.json`). With `running` false, what only stops the spec from running (a
    table too large to run) is not an error: the spec is being planned. `backend` ("cpu",
    "gpu", "tpu") adds what is particular to running there (W005: an attention layer no
    fused kernel takes)."""
    sizes = parse_mesh(mesh)
    values = parse_overrides(overrides)
    replacement = None if schedule is None else _schedule_setting(schedule)
    source, diags = resolve(source_or_path)
    if source is None:
        return Analysis(None, None, None, diags)
    module, diags = parse(source)
    if module is None:
        return Analysis(source, None, None, diags)
    values = check_overrides(module, values)
    if replacement is not None:
        module = _with_schedule(module, replacement, schedule)
    collected = Diagnostics()
    try:
        program = elaborate(module, sizes, collected, values)
        if program is not None and not collected.has_errors:
            check_program(program, collected, running)
            if backend is not None and not collected.has_errors:
                collected.items.extend(kernel_warnings(program, backend))
    except RecursionError:
        span = Span(source.name, 1, 1, 1, 1)
        collected.add(
            error("E003", "the spec is nested too deeply to check", span, help="flatten nested expressions and blocks")
        )
        program = None
    return Analysis(source, module, program, _dedupe(collected.items))


def _schedule_setting(schedule: str) -> ast.ScheduleSetting | ast.ScheduleFile:
    """`--schedule`'s value as the pipeline setting it stands for (spans filled in later)."""
    if schedule.lower().endswith(".json"):
        if not Path(schedule).is_file():
            raise ValueError(f"--schedule {schedule}: no such file")
        # Absolute: a spec's own `schedule file` paths are relative to the spec, this one is not.
        return ast.ScheduleFile(str(Path(schedule).absolute()), NO_SPAN)
    if schedule not in SCHEDULES:
        guess = closest(schedule, SCHEDULES)
        raise ValueError(
            f"unknown schedule {schedule!r}"
            + (f"; did you mean {guess!r}?" if guess else f" (known: {', '.join(SCHEDULES)}, or a table's .json file)")
        )
    return ast.ScheduleSetting(ast.Ident(schedule, NO_SPAN), NO_SPAN)


def _with_schedule(
    module: ast.Module, setting: ast.ScheduleSetting | ast.ScheduleFile, given: str | None
) -> ast.Module:
    """The module with its pipeline's schedule replaced before elaboration, so that what
    follows from the schedule (a V's two chunks per stage) follows from the new one. The new
    setting takes the place, and the span, of the old one."""
    pipelines = [item for item in module.items if isinstance(item, ast.PipelineDef)]
    if not pipelines:
        raise ValueError(f"--schedule {given}: the spec declares no pipeline")
    pipeline = pipelines[0]
    old = next((s for s in pipeline.items if not isinstance(s, ast.Setting)), None)
    span = old.span if old is not None else pipeline.span
    if isinstance(setting, ast.ScheduleSetting):
        setting = ast.ScheduleSetting(ast.Ident(setting.kind.text, span), span)
    else:
        setting = ast.ScheduleFile(setting.path, span)
    items = (setting, *(s for s in pipeline.items if isinstance(s, ast.Setting)))
    return replace(module, items=tuple(replace(pipeline, items=items) if i is pipeline else i for i in module.items))


def _dedupe(items: list[Diagnostic]) -> list[Diagnostic]:
    """One report per place and kind of problem: a block used 24 times has each of its
    mistakes reported once (for its first use), not 24 times."""
    seen: set[tuple[str, Span]] = set()
    out = []
    for d in items:
        key = (d.code, d.span)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return sorted(out, key=sort_key)


class CompileError(Exception):
    """A spec that cannot be compiled; `diagnostics` says why, `str()` shows them rendered."""

    def __init__(self, analysis: Analysis) -> None:
        self.diagnostics = analysis.diagnostics
        sources = {analysis.source.name: analysis.source.text} if analysis.source else {}
        super().__init__(render_text([d for d in self.diagnostics if d.is_error], sources).rstrip())


def check(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Overrides = None,
    schedule: str | None = None,
    backend: str | None = None,
) -> list[Diagnostic]:
    """Every diagnostic for a spec given as text or as a path (see `syntax.source.resolve`).

    `mesh` is "2x4x2" or a sequence of sizes, one per mesh axis in the spec's order; without
    it the spec's own default sizes are used. `backend` as for `analyze`.
    """
    return analyze(source_or_path, mesh, overrides, schedule, backend=backend).diagnostics
