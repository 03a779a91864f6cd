"""The syntax tree of a .par file: what was written, with the span it was written at.

Nodes are frozen, slotted dataclasses with tuple children. Spans do not take part in
equality, so two trees compare equal when they say the same thing (which is what the
formatter's round-trip test relies on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from dslc.diagnostics import Span


@dataclass(frozen=True, slots=True)
class Ident:
    text: str
    span: Span = field(compare=False, repr=False)


# ---- values ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntLit:
    value: int
    text: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class FloatLit:
    value: float
    text: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BoolLit:
    value: bool
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class NameRef:
    name: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Chain:
    """`a op b op c ...` at one precedence level, kept flat (no recursion on long sums)."""

    first: Expr
    rest: tuple[tuple[str, Expr], ...]
    span: Span = field(compare=False, repr=False)


Expr: TypeAlias = "IntLit | NameRef | Neg | Chain"
Value: TypeAlias = "Expr | FloatLit | BoolLit"


# ---- shardings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AxisSet:
    """The mesh axes one dimension is split over; empty means replicated."""

    axes: tuple[Ident, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Dim:
    size: Expr
    sharding: AxisSet | None
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TensorType:
    dtype: Ident
    dims: tuple[Dim, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class WeightShard:
    weight: Ident
    dims: tuple[AxisSet, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class WeightTie:
    """`kernel = wte.table.T`: a weight that is the one `target` names (its dotted path; a
    last part `T` reads it transposed)."""

    weight: Ident
    target: tuple[Ident, ...]
    span: Span = field(compare=False, repr=False)

    @property
    def path(self) -> str:
        return ".".join(i.text for i in self.target)


# ---- header items ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelDecl:
    name: Ident
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class MeshAxis:
    name: Ident
    size: Expr | None
    span: Span = field(compare=False, repr=False)
    nodes: Expr | None = None  # `across N nodes`: how many nodes the axis spans


@dataclass(frozen=True, slots=True)
class MeshDecl:
    axes: tuple[MeshAxis, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ConstDecl:
    name: Ident
    value: Value
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class InputDecl:
    name: Ident
    type: TensorType
    span: Span = field(compare=False, repr=False)


# ---- model body -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arg:
    """A call argument: positional when `name` is None."""

    name: Ident | None
    value: Value
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Call:
    callee: Ident
    args: tuple[Arg, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class LayerStmt:
    label: Ident | None
    call: Call
    shards: tuple[WeightShard, ...]
    ties: tuple[WeightTie, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ResidualStmt:
    label: Ident | None
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BranchStmt:
    """One of consecutive branches that read the same input and whose outputs are summed."""

    label: Ident | None
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class StreamStmt:
    """`stream NAME(SOURCE) { ... }`: the body run on input SOURCE, its output kept as NAME
    (the statement's label, as a layer's: the body's layers are named under it)."""

    label: Ident
    source: Ident
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class RepeatStmt:
    label: Ident | None
    count: Expr
    call: Call | None
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class StageStmt:
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class StagesStmt:
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class LayoutStmt:
    dims: tuple[AxisSet, ...]
    span: Span = field(compare=False, repr=False)


Stmt: TypeAlias = LayerStmt | ResidualStmt | BranchStmt | StreamStmt | RepeatStmt | StageStmt | StagesStmt | LayoutStmt


@dataclass(frozen=True, slots=True)
class Param:
    name: Ident
    default: Value | None
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    policy: Ident
    saved: tuple[Ident, ...]
    has_list: bool
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BlockDef:
    name: Ident
    params: tuple[Param, ...]
    checkpoint: Checkpoint | None
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ForwardDef:
    input: Ident
    body: tuple[Stmt, ...]
    span: Span = field(compare=False, repr=False)


# ---- plan -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    key: Ident
    values: tuple[Value | Call, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ScheduleSetting:
    kind: Ident
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ScheduleFile:
    """`schedule file "PATH"`: a table in the JSON `dslc schedule --format json` prints."""

    path: str  # as written, without the quotes; relative to the spec's folder
    span: Span = field(compare=False, repr=False)


PipelineItem = Setting | ScheduleSetting | ScheduleFile


@dataclass(frozen=True, slots=True)
class PipelineDef:
    axis: Ident
    items: tuple[PipelineItem, ...]
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TrainDef:
    settings: tuple[Setting, ...]
    span: Span = field(compare=False, repr=False)


Item: TypeAlias = ModelDecl | MeshDecl | ConstDecl | InputDecl | BlockDef | ForwardDef | PipelineDef | TrainDef


@dataclass(frozen=True, slots=True)
class Comment:
    text: str
    span: Span = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Module:
    """A whole .par file."""

    items: tuple[Item, ...]
    span: Span = field(compare=False, repr=False)
    comments: tuple[Comment, ...] = field(default=(), compare=False)
