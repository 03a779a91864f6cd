"""The front end as one call: source -> AST -> IR -> checked IR, with every diagnostic.

Imports no accelerator stack: `dslc check` answers in milliseconds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dslc.check import check_program
from dslc.diagnostics import NO_SPAN, Diagnostic, Diagnostics, Span, error, has_errors, render_text, sort_key
from dslc.ir.elaborate import elaborate
from dslc.ir.names import closest
from dslc.ir.nodes import Program
from dslc.schedules import KINDS as SCHEDULES
from dslc.syntax import ast
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


def parse_overrides(pairs: Sequence[str] | Mapping[str, int] | None) -> dict[str, int]:
    """`["layers=4", "seq=64"]` (or a mapping) to constant overrides; ValueError when malformed."""
    if pairs is None:
        return {}
    if isinstance(pairs, Mapping):
        items = list(pairs.items())
    else:
        items = []
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if (
                not sep
                or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip())
                or not re.fullmatch(r"-?[0-9]{1,18}", value.strip())
            ):
                raise ValueError(f"--set takes NAME=INTEGER, got {pair!r}")
            items.append((name.strip(), int(value)))
    out: dict[str, int] = {}
    for name, number in items:
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(f"constant `{name}` must be set to an integer, got {number!r}")
        out[name] = number
    return out


def analyze(
    source_or_path: str | os.PathLike[str],
    mesh: MeshArg = None,
    overrides: Sequence[str] | Mapping[str, int] | None = None,
    schedule: str | None = None,
    running: bool = True,
) -> Analysis:
    """Parse, elaborate and check a spec. `overrides` sets constants (`{"layers": 4}`);
    `schedule` replaces the pipeline schedule the spec names: a kind, or the path of a table
    in JSON (`*.json`). With `running` false, what only stops the spec from running (a
    schedule the executor cannot run yet) is not an error: the spec is being planned."""
    sizes = parse_mesh(mesh)
    values = parse_overrides(overrides)
    replacement = None if schedule is None else _schedule_setting(schedule)
    source, diags = resolve(source_or_path)
    if source is None:
        return Analysis(None, None, None, diags)
    module, diags = parse(source)
    if module is None:
        return Analysis(source, None, None, diags)
    declared = {item.name.text for item in module.items if isinstance(item, ast.ConstDecl)}
    for name in values:
        if name not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise ValueError(f"cannot set `{name}`: the spec defines no constant `{name}` (it has: {known})")
    if replacement is not None:
        module = _with_schedule(module, replacement, schedule)
    collected = Diagnostics()
    try:
        program = elaborate(module, sizes, collected, values)
        if program is not None and not collected.has_errors:
            check_program(program, collected, running)
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
    overrides: Sequence[str] | Mapping[str, int] | None = None,
    schedule: str | None = None,
) -> list[Diagnostic]:
    """Every diagnostic for a spec given as text or as a path (see `syntax.source.resolve`).

    `mesh` is "2x4x2" or a sequence of sizes, one per mesh axis in the spec's order; without
    it the spec's own default sizes are used.
    """
    return analyze(source_or_path, mesh, overrides, schedule).diagnostics
