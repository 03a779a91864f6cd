"""The IR: the checked model every later stage reads (lowering, codegen, planner).

Plain frozen data. Shapes are global (logical) shapes; `sharding` says, per dimension, which
mesh axes split it. Spans point back at the text each node came from and are left out of
equality, so two programs compare equal when they mean the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from dslc.diagnostics import NO_SPAN, Span

Axes: TypeAlias = tuple[str, ...]
Sharding: TypeAlias = tuple[Axes, ...]

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "bool": 1}
FLOAT_DTYPES = ("f32", "bf16", "f16", "f64")
INT_DTYPES = ("i32", "i64", "i8")


@dataclass(frozen=True, slots=True)
class MeshAxis:
    name: str
    size: int
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Mesh:
    axes: tuple[MeshAxis, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    def size(self, axes: Axes) -> int:
        """How many pieces a dimension split over `axes` is cut into."""
        # A loop rather than a dict of sizes: the planner asks this for every tensor it counts.
        return math.prod(a.size for a in self.axes if a.name in axes)

    def describe(self) -> str:
        return "x".join(str(s) for s in self.shape) + f" ({', '.join(self.names)})"


@dataclass(frozen=True, slots=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]
    sharding: Sharding

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.sharding), (self.shape, self.sharding)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def axes_used(self) -> Axes:
        return tuple(a for dim in self.sharding for a in dim)

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        return tuple(-(-n // mesh.size(axes)) for n, axes in zip(self.shape, self.sharding, strict=True))

    def local_nbytes(self, mesh: Mesh) -> int:
        return math.prod(self.local_shape(mesh)) * DTYPE_BYTES[self.dtype]

    def slice_numel(self, mesh: Mesh, slices: int = 1) -> int:
        """Elements on one device for one of `slices` equal slices of the batch (the leading
        dimension, rounded up): what one microbatch's forward call sees."""
        shape = self.local_shape(mesh)
        if not shape:
            return 1
        return -(-shape[0] // slices) * math.prod(shape[1:])

    def describe(self) -> str:
        dims = ", ".join(
            f"{n}@{_axes_text(axes)}" if axes else str(n) for n, axes in zip(self.shape, self.sharding, strict=True)
        )
        return f"{self.dtype}[{dims}]"


def _axes_text(axes: Axes) -> str:
    return axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def replicated(dtype: str, shape: tuple[int, ...]) -> TensorType:
    return TensorType(dtype, shape, tuple(() for _ in shape))


@dataclass(frozen=True, slots=True)
class Weight:
    """A parameter of a layer: `name` is local to the layer (kernel, bias, q, ...)."""

    name: str
    type: TensorType
    init: str
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


# "collective-permute": every device of the group sends its piece of the tensor to one other
# device, once (a ring pass, or a reordering of the pieces).
CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]


@dataclass(frozen=True, slots=True)
class Collective:
    """A collective a layer's sharding implies, on a tensor of `elements` global elements."""

    kind: CollectiveKind
    axes: Axes
    elements: int
    dtype: str
    why: str


@dataclass(frozen=True, slots=True)
class Layer:
    path: str
    kind: str
    attrs: tuple[tuple[str, object], ...]
    weights: tuple[Weight, ...]
    input: TensorType
    output: TensorType
    collectives: tuple[Collective, ...] = ()
    flops: int = 0
    # The input's sharding while the layer computes: differs from `input.sharding` where
    # the layer gathers split tokens first (sequence parallelism).
    operand: Sharding = ()
    span: Span = field(default=NO_SPAN, compare=False, repr=False)

    def attr(self, name: str) -> object:
        return dict(self.attrs)[name]

    def weight(self, name: str) -> Weight:
        return next(w for w in self.weights if w.name == name)


@dataclass(frozen=True, slots=True)
class Remat:
    """Activation checkpointing of a block: none, full, or selective (saving named outputs)."""

    policy: Literal["none", "full", "selective"] = "none"
    saved: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Residual:
    """y = x + body(x)."""

    path: str
    body: tuple[Node, ...]
    input: TensorType
    output: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Block:
    """One use of a user-defined block."""

    path: str
    block: str
    remat: Remat
    body: tuple[Node, ...]
    input: TensorType
    output: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Layout:
    """A declared change of the activation's sharding between layers."""

    path: str
    input: TensorType
    output: TensorType
    collectives: tuple[Collective, ...] = ()
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


Node: TypeAlias = Layer | Residual | Block | Layout


@dataclass(frozen=True, slots=True)
class Chunk:
    """A contiguous run of the model: one pipeline stage's share (one of V per device)."""

    index: int
    stage: int
    virtual: int
    nodes: tuple[Node, ...]
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Pipeline:
    axis: str
    schedule: str
    microbatches: int
    virtual: int
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Optimizer:
    name: str
    hyper: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Train:
    """How parameters, gradients and optimizer state are kept, and how steps are taken."""

    zero: int = 0
    shard_axes: Axes = ()
    accumulate: int = 1
    param_dtype: str = "f32"
    compute_dtype: str = "f32"
    optimizer: Optimizer = Optimizer("adamw", ())
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Input:
    name: str
    type: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Program:
    name: str
    mesh: Mesh
    constants: tuple[tuple[str, int | float | bool], ...]
    inputs: tuple[Input, ...]
    stream: str
    chunks: tuple[Chunk, ...]
    pipeline: Pipeline | None
    train: Train
    span: Span = field(default=NO_SPAN, compare=False, repr=False)

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)


# ---- walking ----------------------------------------------------------------------------------


def children(node: Node) -> tuple[Node, ...]:
    match node:
        case Residual(body=body) | Block(body=body):
            return body
        case Layer() | Layout():
            return ()


def walk(nodes: tuple[Node, ...]) -> list[Node]:
    """Every node in order, parents before children."""
    out: list[Node] = []
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(children(node)))
    return out


def layers(nodes: tuple[Node, ...]) -> list[Layer]:
    return [n for n in walk(nodes) if isinstance(n, Layer)]


def all_layers(program: Program) -> list[Layer]:
    return [layer for chunk in program.chunks for layer in layers(chunk.nodes)]


def weights_by_path(program: Program) -> dict[str, Weight]:
    """Every parameter under its stable dotted name, e.g. `layers.3.attn.q`."""
    return {f"{layer.path}.{w.name}": w for layer in all_layers(program) for w in layer.weights}
