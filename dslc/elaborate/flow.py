"""What the walk of the forward body carries from one statement to the next."""

from __future__ import annotations

from dataclasses import dataclass, field

from dslc.diagnostics import Diagnostics, Span
from dslc.elaborate.header import Header
from dslc.elaborate.ties import Declared
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue

# A typed IR needs a type for the activation after a layer that could not be typed; this
# marks it, and layers that receive it are not typed (which would only repeat the error).
UNKNOWN = ir.TensorType("unknown", (), ())

Scope = dict[str, ScalarValue]


@dataclass
class Segment:
    """A top-level run of the forward body: loose layers, one `stage`, or a `stages` region."""

    kind: str  # "loose" | "stage" | "stages"
    nodes: list[ir.Node]
    span: Span


@dataclass
class Flow:
    """The activation flowing through a sequence: its type and where it was produced."""

    type: ir.TensorType
    span: Span
    after_loss: Span | None = None
    # The classes of logits whose last dimension a padded vocabulary widened (the loss masks
    # the rest out); None where nothing is padded.
    classes: int | None = None


@dataclass(frozen=True, slots=True)
class UnevenSplit:
    """A weight dimension that does not split evenly over its mesh axes (E014, reported), kept
    so that the walk can say one wrong mesh size once rather than once per weight. The report
    is found again by its place and message: a block's use relabels the reports from its body."""

    span: Span
    message: str
    weight: str  # its dotted name
    over: str  # the axes and their sizes, as the message says them: `model=3`
    size: int


@dataclass
class Walk:
    """What the walk of the forward body has seen so far, which typing a layer reads."""

    header: Header
    diags: Diagnostics
    # The input the body reads.
    stream: str = ""
    # Every weight elaborated so far, by dotted name: what a `tie` may name.
    declared: dict[str, Declared] = field(default_factory=dict)
    # Blocks and repeats the statement being elaborated is inside, and of those repeats.
    depth: int = 0
    repeats: int = 0
    # The calls of heads right before a loss that masks padded logits (by id).
    heads: set[int] = field(default_factory=set)
    # Weight dimensions reported as not splitting evenly (E014), in the order reported.
    uneven: list[UnevenSplit] = field(default_factory=list)
    # The `stream`s computed so far, as the inputs their readers take them for, and those
    # whose type is unknown (a mistake in their body, reported).
    streams: dict[str, ir.Input] = field(default_factory=dict)
    untyped_streams: set[str] = field(default_factory=set)
    # How each name in scope is written in the spec's own constants (`d`, `4 * d`), innermost
    # block last: what lets the generated module name a value by the constant it came from.
    spellings: list[dict[str, str]] = field(default_factory=list)

    @property
    def readable(self) -> dict[str, ir.Input]:
        """What a layer may read by name: the declared inputs and the streams computed so far."""
        return {**self.header.inputs, **self.streams}

    @property
    def untyped(self) -> set[str]:
        """The readable names without a type (reported where they were declared)."""
        return self.header.untyped_inputs | self.untyped_streams
