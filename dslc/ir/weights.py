"""How weights given by name differ from a program's."""

from __future__ import annotations

from collections.abc import Mapping

from dslc.ir.nodes import Program, weights_by_path


def mismatches(program: Program, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What is wrong with weights of these names and shapes for `program`: one line each for
    the missing, those it does not have, and those of another shape; empty when they fit."""
    expected = weights_by_path(program)
    missing = [n for n in expected if n not in shapes]
    unknown = [n for n in shapes if n not in expected]
    misshapen = [
        f"`{n}` is {shapes[n]}, the spec says {w.shape}"
        for n, w in expected.items()
        if n in shapes and tuple(shapes[n]) != w.shape
    ]
    problems = [
        _listing(len(missing), "missing", [f"`{n}`" for n in missing]),
        _listing(len(unknown), "not in the spec", [f"`{n}`" for n in unknown]),
        _listing(len(misshapen), "of the wrong shape", misshapen),
    ]
    return [p for p in problems if p]


def _listing(count: int, what: str, examples: list[str], shown: int = 3) -> str:
    if not count:
        return ""
    more = f", and {count - shown} more" if count > shown else ""
    return f"{count} {what} ({', '.join(examples[:shown])}{more})"
