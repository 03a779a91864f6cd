"""The IR: the checked model every later stage reads (lowering, codegen, planner).

Plain frozen data. Shapes are global (logical) shapes; `sharding` says, per dimension, which
mesh axes split it. Spans point back at the text each node came from and are left out of
equality, so two programs compare equal when they mean the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias

from dslc.diagnostics import NO_SPAN, Span
from dslc.runtime.storage import expand_names
from dslc.schedules.table import Schedule

Axes: TypeAlias = tuple[str, ...]
Sharding: TypeAlias = tuple[Axes, ...]


@dataclass(frozen=True, slots=True)
class DType:
    """An element type as a spec writes it (`bf16`): its size and its name in numpy/jax."""

    bytes: int
    jax: str
    floating: bool


# The one table of element types: every stage reads sizes and jax names from here.
DTYPES = {
    "f32": DType(4, "float32", True),
    "bf16": DType(2, "bfloat16", True),
    "f16": DType(2, "float16", True),
    "f64": DType(8, "float64", True),
    "i32": DType(4, "int32", False),
    "i64": DType(8, "int64", False),
    "i8": DType(1, "int8", False),
    "bool": DType(1, "bool", False),
}
DTYPE_BYTES = {name: t.bytes for name, t in DTYPES.items()}
FLOAT_DTYPES = tuple(name for name, t in DTYPES.items() if t.floating)
INT_DTYPES = tuple(name for name, t in DTYPES.items() if not t.floating and name != "bool")


@dataclass(frozen=True, slots=True)
class MeshAxis:
    name: str
    size: int
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    # How many nodes (hosts, or TPU slices) the axis spans: its groups cross the slow network
    # between nodes when above 1, and the `size // nodes` devices of each node's share of it
    # stay on the fast one inside.
    nodes: int = 1


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

    @property
    def nodes(self) -> int:
        """How many nodes the mesh spans (1 unless an axis is declared `across N nodes`)."""
        return math.prod(a.nodes for a in self.axes)

    @property
    def across_nodes(self) -> tuple[str, ...]:
        """The axes whose groups cross nodes, in order."""
        return tuple(a.name for a in self.axes if a.nodes > 1)

    def describe(self) -> str:
        if not self.axes:
            return "1 (no axes)"
        crossing = "".join(f"; {a.name} across {a.nodes} nodes" for a in self.axes if a.nodes > 1)
        return "x".join(str(s) for s in self.shape) + f" ({', '.join(self.names)}{crossing})"


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
    """A parameter of a layer: `name` is local to the layer (kernel, bias, q, ...). A tied
    weight (`tie`) is another layer's, stored once: `type` is how this layer reads it."""

    name: str
    type: TensorType
    init: str
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    tie: Tie | None = None
    # Elements added at the end of each dimension of `type` (a vocabulary padded to split
    # evenly): stored and computed with, never exported. Empty: none.
    padding: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the spec declares, as weights are exported and imported: without padding."""
        if not self.padding:
            return self.type.shape
        return tuple(n - pad for n, pad in zip(self.type.shape, self.padding, strict=True))

    @property
    def stored(self) -> Weight:
        """The weight as it is kept: the one it is tied to, or itself."""
        return self.tie.stored if self.tie is not None else self


@dataclass(frozen=True, slots=True)
class Tie:
    """What a tied weight reads: the weight of another layer named `name` (`wte.table`), as
    that layer declared it, transposed where `transposed` (a head reading an embedding)."""

    name: str
    stored: Weight
    transposed: bool


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
    # The declared inputs and streams the layer reads besides its input, by argument, with
    # their types (a loss's targets, cross-attention's memory).
    reads: tuple[tuple[str, TensorType], ...] = ()
    # Arguments as the spec wrote them in its constants (`ffn` -> "4 * d"), by name: how the
    # generated module names their values. Not part of what the layer means.
    written: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def attr(self, name: str) -> object:
        """An argument by its name, untyped: for readers that must not share the rules' parsing
        (the tests' independent reference); dslc reads them typed, `dslc.layers.args`."""
        return dict(self.attrs)[name]

    def weight(self, name: str) -> Weight:
        return next(w for w in self.weights if w.name == name)


RematPolicy = Literal["none", "full", "selective", "core_attention"]


@dataclass(frozen=True, slots=True)
class Remat:
    """Activation checkpointing of a block: none, full, selective, or core_attention. `saved`
    holds the full paths of the layers whose outputs a selective block keeps (`blocks.attn`).
    `core_attention` keeps every activation but the attention cores of the layers of the
    block's own body (`own_layers`), which the backward pass recomputes."""

    policy: RematPolicy = "none"
    saved: tuple[str, ...] = ()

    @property
    def reruns_block(self) -> bool:
        """Whether the backward pass reruns the block's forward (all of it but what it saves),
        its collectives included."""
        return self.policy in ("full", "selective")


@dataclass(frozen=True, slots=True)
class Residual:
    """y = x + body(x)."""

    path: str
    body: tuple[Node, ...]
    input: TensorType
    output: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Branches:
    """y = arm_1(x) + arm_2(x) + ...: consecutive `branch` statements, each reading the same
    input (GPT-NeoX's and PaLM's parallel attention and MLP). The arms' outputs agree in shape
    and sharding."""

    path: str
    arms: tuple[tuple[Node, ...], ...]
    input: TensorType
    output: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    arm_spans: tuple[Span, ...] = field(default=(), compare=False, repr=False)  # each `branch { }`

    @property
    def body(self) -> tuple[Node, ...]:
        """Every arm's nodes, one arm after another: the order the forward pass runs them in."""
        return tuple(node for arm in self.arms for node in arm)


@dataclass(frozen=True, slots=True)
class Stream:
    """`stream NAME(SOURCE) { ... }`: a second activation, `body` run on the declared input
    `source`, kept under `path` (its name) for the layers that read it (cross-attention's
    memory, T5's position bias) as they read a declared input. The activation of `forward`
    passes by unchanged: `input` is `output`; `result` is what the body computes."""

    path: str
    source: str
    body: tuple[Node, ...]
    input: TensorType
    output: TensorType
    result: TensorType
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


@dataclass(frozen=True, slots=True)
class Repeat:
    """`count` consecutive uses of one block (`blocks: repeat 24 gpt_block(...)`), elaborated
    once: `body` is the block, its layers' paths under `path` with no index (`blocks.attn`).

    Its weights are stored stacked, one array per weight of the block with the layer index
    first; layer i's weights are named `{path}.{i}.…` (`blocks.3.attn.q`) only where they are
    exported one by one. A pipeline stage may run a share of the run: layers `first` to
    `first + count - 1` of the `total` the statement wrote.
    """

    path: str
    body: Block
    count: int
    first: int = 0
    total: int = 0  # the whole run's length; 0 means `count` (the node is the whole run)
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    # The count as the spec wrote it in its constants (`layers // 2`); "" for a literal.
    written: str = field(default="", compare=False)

    @property
    def input(self) -> TensorType:
        return self.body.input

    @property
    def output(self) -> TensorType:
        return self.body.output

    @property
    def length(self) -> int:
        """Layers in the whole run (every stage's share together)."""
        return self.total or self.count


Node: TypeAlias = Layer | Residual | Branches | Stream | Block | Layout | Repeat


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
    """The `pipeline` section. `schedule` names a built-in kind, or labels `table`, a table
    read from a file (already validated, and of this pipeline's stages and microbatches)."""

    axis: str
    schedule: str
    microbatches: int
    virtual: int
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    table: Schedule | None = field(default=None, repr=False)


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
    # The dtype of a master copy of the parameters kept with the optimizer state (mixed
    # precision: 16-bit parameters and gradients, the update on the master); None: the
    # parameters are their own master.
    master_dtype: str | None = None
    # The dtype gradients are summed in — over microbatches, accumulation steps and devices —
    # where wider than the parameters' (Megatron's `main_grad`); None: the parameters'.
    grad_dtype: str | None = None
    optimizer: Optimizer = Optimizer("adamw", ())
    span: Span = field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Input:
    name: str
    type: TensorType
    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    # Each dimension as the spec wrote it, in its constants (`batch`, `4 * seq`); "" where
    # it names none. The generated module spells the input's shape so.
    written: tuple[str, ...] = field(default=(), compare=False, repr=False)


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
    # The layer that ends the forward pass with the training objective (the last node of the
    # last chunk), or None for a spec that only computes an output.
    loss: Layer | None = None
    span: Span = field(default=NO_SPAN, compare=False, repr=False)

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)

    @property
    def nodes(self) -> tuple[Node, ...]:
        """Every top-level node, chunk after chunk."""
        return tuple(n for chunk in self.chunks for n in chunk.nodes)

    @property
    def body(self) -> tuple[Node, ...]:
        """The model's nodes before its loss."""
        nodes = self.nodes
        return nodes[:-1] if self.loss is not None else nodes

    @property
    def streams(self) -> tuple[Stream, ...]:
        """The `stream` statements of the forward body, in order."""
        return tuple(n for n in self.nodes if isinstance(n, Stream))

    def chunk_body(self, chunk: Chunk) -> tuple[Node, ...]:
        """A chunk's nodes, less the loss where the chunk ends in it."""
        last = self.loss is not None and chunk is self.chunks[-1]
        return chunk.nodes[:-1] if last else chunk.nodes

    @property
    def stages(self) -> int:
        """Devices along the pipeline axis (1 without a pipeline)."""
        return self.mesh.size((self.pipeline.axis,)) if self.pipeline is not None else 1

    @property
    def pipelined(self) -> bool:
        """Whether the step runs the pipeline executor: more than one chunk in its table."""
        return self.pipeline is not None and self.stages * self.pipeline.virtual > 1

    @property
    def boundaries(self) -> tuple[TensorType, ...]:
        """What each chunk but the last hands the next: its output."""
        return tuple(chunk.nodes[-1].output for chunk in self.chunks[:-1] if chunk.nodes)


# ---- walking ----------------------------------------------------------------------------------


def children(node: Node) -> tuple[Node, ...]:
    match node:
        case Residual(body=body) | Branches(body=body) | Stream(body=body) | Block(body=body):
            return body
        case Repeat(body=block):
            return (block,)
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
    """Every layer node once: a repeat's block counts once, however many times it runs."""
    return [n for n in walk(nodes) if isinstance(n, Layer)]


def all_layers(program: Program) -> list[Layer]:
    return layers(program.nodes)


def own_layers(body: tuple[Node, ...]) -> list[Layer]:
    """The layers of a block's own body, through its residuals but not into the blocks and
    repeats it uses, which checkpoint by policies of their own."""
    out: list[Layer] = []
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, Layer):
            out.append(node)
        elif isinstance(node, Residual | Branches | Stream):
            stack.extend(reversed(node.body))
    return out


def counted(nodes: tuple[Node, ...], times: int = 1) -> list[tuple[Node, int]]:
    """Every node with how many times one pass over `nodes` runs it (a repeat's body runs
    `count` times, a repeat inside it that many times more), parents before children."""
    out: list[tuple[Node, int]] = []
    for node in nodes:
        out.append((node, times))
        inner = times * node.count if isinstance(node, Repeat) else times
        out.extend(counted(children(node), inner))
    return out


def counted_layers(nodes: tuple[Node, ...]) -> list[tuple[Layer, int]]:
    """Every layer node with the number of times one pass over `nodes` runs it."""
    return [(n, times) for n, times in counted(nodes) if isinstance(n, Layer)]


def unrolled(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """The nodes with every repeat written out as its copies, each a block whose paths carry
    its index (`blocks.attn` -> `blocks.3.attn`): the model as a reader of its per-layer
    weight names sees it."""
    out: list[Node] = []
    for node in nodes:
        match node:
            case Repeat():
                for i in range(node.first, node.first + node.count):
                    copy = _renamed(node.body, node.path, i)
                    assert isinstance(copy, Block)
                    out.append(replace(copy, body=unrolled(copy.body)))
            case Residual() | Stream() | Block():
                out.append(replace(node, body=unrolled(node.body)))
            case Branches():
                out.append(replace(node, arms=tuple(unrolled(arm) for arm in node.arms)))
            case Layer() | Layout():
                out.append(node)
    return tuple(out)


def _renamed(node: Node, prefix: str, index: int) -> Node:
    """`node` with `prefix`'s paths below it given `index` (`prefix.rest` -> `prefix.index.rest`)."""
    path = node.path
    if path == prefix or path.startswith(prefix + "."):
        path = f"{prefix}.{index}{path[len(prefix) :]}"
    match node:
        case Layer() | Layout():
            return replace(node, path=path)
        case Residual() | Stream() | Block():
            return replace(node, path=path, body=tuple(_renamed(c, prefix, index) for c in node.body))
        case Branches():
            arms = tuple(tuple(_renamed(c, prefix, index) for c in arm) for arm in node.arms)
            return replace(node, path=path, arms=arms)
        case Repeat():
            body = _renamed(node.body, prefix, index)
            assert isinstance(body, Block)
            return replace(node, path=path, body=body)


@dataclass(frozen=True, slots=True)
class StackedWeight:
    """A weight of a layer as it is stored: one array for every layer of the repeats around
    it, whose lengths lead its shape (`blocks.*.attn.q`, [24, d, d])."""

    name: str  # the layer's path with `*` after each enclosing repeat's: `blocks.*.attn.q`
    weight: Weight
    layer: Layer
    repeats: tuple[Repeat, ...]  # enclosing repeats, outermost first

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(r.length for r in self.repeats)

    @property
    def stored(self) -> Weight:
        """The weight as it is kept (for a tied weight, the one it reads)."""
        return self.weight.stored

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lengths, *self.stored.type.shape)

    def names(self) -> list[str]:
        """The per-layer dotted names of its rows, in row-major order (`blocks.0.attn.q`, ...)."""
        return expand_names(self.name, self.lengths)


def stacked_weights(nodes: tuple[Node, ...]) -> list[StackedWeight]:
    """Every weight under `nodes` as stored (a repeat's share in a pipeline chunk names the
    whole run's array; a tied weight the array it reads, which then appears once per use)."""
    out: list[StackedWeight] = []

    def visit(node: Node, repeats: tuple[Repeat, ...]) -> None:
        match node:
            case Layer():
                for w in node.weights:
                    # A tied weight is stored under the name of the weight it reads.
                    name = w.tie.name if w.tie is not None else _starred(f"{node.path}.{w.name}", repeats)
                    out.append(StackedWeight(name, w, node, repeats))
            case Repeat():
                visit(node.body, (*repeats, node))
            case Residual() | Branches() | Stream() | Block():
                for child in node.body:
                    visit(child, repeats)
            case Layout():
                pass

    for node in nodes:
        visit(node, ())
    return out


def _starred(path: str, repeats: tuple[Repeat, ...]) -> str:
    """`blocks.sub.lin.w` under repeats `blocks` and `blocks.sub` -> `blocks.*.sub.*.lin.w`."""
    parts = path.split(".")
    # Insert from the innermost repeat out, so the earlier insertion points stay put.
    for r in reversed(repeats):
        depth = len(r.path.split("."))
        parts.insert(depth, "*")
    return ".".join(parts)


def weights_by_path(program: Program) -> dict[str, Weight]:
    """Every parameter under its stable dotted per-layer name, e.g. `layers.3.attn.q`."""
    seen: set[str] = set()
    out: dict[str, Weight] = {}
    for sw in stacked_weights(program.nodes):
        if sw.name in seen:
            continue
        seen.add(sw.name)
        for name in sw.names():
            out[name] = sw.stored
    return out


def parameter_count(program: Program) -> int:
    """The model's parameters as the spec declares them: a tied weight once, no padding."""
    return sum(math.prod(w.shape) for w in weights_by_path(program).values())
