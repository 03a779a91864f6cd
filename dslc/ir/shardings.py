"""Turning written shardings into IR shardings, checking each axis where it was written."""

from __future__ import annotations

from collections.abc import Sequence

from dslc.diagnostics import Diagnostics, Label
from dslc.ir.names import unknown_name
from dslc.ir.nodes import Axes, Mesh, Sharding
from dslc.syntax import ast

_MAX_LISTED = 12


def divisor_sizes(n: int, limit: int = 1024) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def resolve(
    axis_sets: Sequence[ast.AxisSet],
    shape: Sequence[int | None],
    what: str,
    mesh: Mesh,
    pipeline_axis: str | None,
    diags: Diagnostics,
) -> Sharding:
    """Check and convert one tensor's per-dimension axes. Bad axes are dropped (after being
    reported) so later passes see a well-formed tensor and do not pile on more errors. A size
    of None is unknown (its own mistake already reported) and is not checked for splitting."""
    seen: dict[str, ast.Ident] = {}
    out: list[Axes] = []
    for dim, (axis_set, size) in enumerate(zip(axis_sets, shape, strict=True)):
        kept: list[str] = []
        for ident in axis_set.axes:
            name = ident.text
            if name not in mesh.names:
                diags.add(unknown_name("mesh axis", name, ident.span, mesh.names, code="E012"))
                continue
            if name == pipeline_axis:
                diags.error(
                    "E012",
                    f"`{name}` is the pipeline axis; it splits the model into stages, not tensors",
                    ident.span,
                    help="split this dimension over another axis, or leave it replicated (`_`)",
                )
                continue
            if name in seen:
                diags.error(
                    "E013",
                    f"mesh axis `{name}` is used twice in the sharding of {what}",
                    ident.span,
                    labels=[Label(seen[name].span, "first used here")],
                    help="a mesh axis can split at most one dimension of a tensor",
                )
                continue
            seen[name] = ident
            kept.append(name)
        axes = tuple(kept)
        pieces = mesh.size(axes)
        if size is not None and size % pieces:
            sizes_of = " x ".join(f"{a}={mesh.size((a,))}" for a in axes)
            works = divisor_sizes(size)
            listed = ", ".join(map(str, works[:_MAX_LISTED])) + (", ..." if len(works) > _MAX_LISTED else "")
            diags.error(
                "E014",
                f"dimension {dim} of {what} has size {size}, which does not split evenly over "
                f"{sizes_of} ({pieces} pieces)",
                axis_set.span,
                notes=[f"mesh {mesh.describe()}", f"{size} splits evenly into {listed} pieces"],
                help="choose mesh sizes whose product divides the dimension, or change the dimension",
            )
            axes = ()
        out.append(axes)
    return tuple(out)
