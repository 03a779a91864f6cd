"""What each mesh axis of a spec is for, read from how the spec uses it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dslc.ir.nodes import Layer, Layout, Program, walk


@dataclass(frozen=True, slots=True)
class Roles:
    """What each mesh axis of a spec is for, read from how the spec uses it."""

    names: tuple[str, ...]
    data: tuple[str, ...]
    tensor: tuple[str, ...]
    pipeline: str | None
    shaping: tuple[str, ...]  # the axes that split a weight, or an activation past its batch dimension

    def role(self, axis: str) -> str:
        if axis in self.data:
            return "data"
        if axis == self.pipeline:
            return "pipeline"
        return "tensor" if axis in self.tensor else "unused"

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(a for a in self.names if self.role(a) != "unused")

    def innermost_first(self, sizes: Sequence[int]) -> list[tuple[str, int]]:
        """The axes in the order devices are numbered along them (see `step_time`)."""
        size = dict(zip(self.names, sizes, strict=True))
        order = [*self.tensor, *self.data, *([self.pipeline] if self.pipeline else [])]
        return [(a, size[a]) for a in order]


def read_roles(program: Program) -> Roles:
    """Each mesh axis's role, from the shardings of the program's inputs, weights and activations."""
    data = program.input(program.stream).type.sharding[0] if program.inputs else ()
    pipeline = program.pipeline.axis if program.pipeline else None
    activations = [inp.type.sharding for inp in program.inputs]
    shaping: set[str] = set()
    for node in walk(program.nodes):
        if isinstance(node, Layer | Layout):
            activations += [node.input.sharding, node.output.sharding]
        if isinstance(node, Layer):
            activations.append(node.operand)
            shaping.update(a for w in node.weights for a in w.type.axes_used)
    shaping.update(a for sharding in activations for dim in sharding[1:] for a in dim)
    used = shaping | set(program.train.shard_axes) | {a for sharding in activations if sharding for a in sharding[0]}
    names = program.mesh.names
    tensor = tuple(a for a in names if a in used and a not in data and a != pipeline)
    return Roles(names, tuple(data), tensor, pipeline, tuple(a for a in names if a in shaping))
