"""What the templates print: the checked IR arranged as a Python module's classes.

Plain data, decided here so the templates only print: which classes there are (one per
distinct block, one per distinct pipeline chunk or one for the whole model), their
attributes, and each `__call__` as a flat list of statements.

A class is built from a dict of its weights: a top-level class (the model, or a pipeline
chunk) by the stored names (`embed.table`, `blocks.*.attn.q`), a block by names relative to
it (`attn.q`). A `repeat` is one instance of its block holding every layer's weights stacked,
run by `scan_layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Literal

from dslc.codegen.names import Namer, attribute_namer, class_name, comment
from dslc.ir import nodes as ir
from dslc.ir.signature import signature
from dslc.layers import RULES
from dslc.layers.base import BoundKernel, input_args

# Comments carry the spec line they came from, cut to stay within the line length.
COMMENT_WIDTH = 100


class Code(str):
    """Python written out as it stands (a spec constant's name, `4 * D`), not as a literal."""


# A name in an argument as the spec wrote it: a constant, `true` or `false`.
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")


@dataclass(frozen=True, slots=True)
class Path:
    """A dotted name as code: relative to the enclosing block's `self.path`, or absolute."""

    text: str
    in_block: bool


@dataclass(frozen=True, slots=True)
class WeightArg:
    """One weight a layer's kernel takes, under its name: the attribute holding the layer's
    weights, and how the weight is read from there."""

    attribute: str
    name: str
    sharding: ir.Sharding | None  # the sharding it is gathered to, where it is stored split
    transposed: bool = False  # a tied weight read the other way round (a head reading an embedding)


@dataclass(frozen=True, slots=True)
class Statement:
    kind: Literal["layer", "copy", "branch", "add", "sum", "stream", "keep", "layout", "block", "scan"]
    var: str
    source: str = ""  # where it was written: "gpt_small.par:24  attn: attention(...)"
    # layer
    kernel: str = ""
    operand: ir.Sharding | None = None  # constrain the input first (sequence-parallel gathers)
    weights: tuple[WeightArg, ...] = ()
    inputs: tuple[tuple[str, str], ...] = ()  # keyword, model input name
    key: Path | None = None  # the layer draws random numbers keyed by this path
    static: tuple[tuple[str, object], ...] = ()
    output: ir.Sharding | None = None
    shape: str = ""  # layer: its output as the spec types it, `bf16[16@data, 128, 512]`
    path: Path | None = None  # layer: the name a selective checkpoint keeps its output by, if it does
    # copy / branch / add: the other variable; sum: the variables summed; layout: the sharding;
    # stream: the input it starts from; keep: the name the layers that read it use
    other: str = ""
    others: tuple[str, ...] = ()
    sharding: ir.Sharding = ()
    # block / scan
    attribute: str = ""
    count: int | Code = 0  # scan: the layers it runs
    # layer: its kernel returns (y, auxiliary values)
    has_aux: bool = False


@dataclass(frozen=True, slots=True)
class Attribute:
    """`self.NAME = ...` in `__init__`: a layer's weights, a block, or a repeat's layers."""

    kind: Literal["weights", "block", "layers"]
    name: str
    source: str
    weights: tuple[tuple[str, str], ...] = ()  # weight name, its key in the class's dict
    cls: str = ""
    prefix: str = ""  # a block's or repeat's keys in the class's dict start with this
    path: Path | None = None  # the block's own path (for a repeat: its layers')


@dataclass
class ModuleClass:
    name: str
    doc: str
    source: str
    attributes: list[Attribute] = field(default_factory=list)
    statements: list[Statement] = field(default_factory=list)
    remat: str = "none"
    saved: tuple[Path, ...] = ()
    is_block: bool = True
    # A repeated block's weights as one layer holds them, a row of code each (name, shape,
    # init, shardings), which `PARAMETERS` stacks; empty where the table stays there.
    weights_table: list[str] = field(default_factory=list)
    weights_columns: tuple[str, ...] = ()


@dataclass
class Builder:
    program: ir.Program
    source_lines: list[str]
    file: str
    global_names: Namer
    blocks: list[ModuleClass] = field(default_factory=list)
    _block_classes: dict[object, str] = field(default_factory=dict)
    # The spec's constants the module names, by their names in the spec, in the order met.
    constants: dict[str, str] = field(default_factory=dict)

    def code(self, written: str) -> Code | None:
        """An argument as the spec wrote it, in the module's names for its constants; None
        when it names no constant (a literal is written as its value)."""
        known = dict(self.program.constants)
        if not any(word in known for word in _WORD.findall(written)):
            return None

        def word(match: re.Match[str]) -> str:
            name = match.group(0)
            if name in ("true", "false"):
                return "True" if name == "true" else "False"
            if name not in self.constants:
                self.constants[name] = self.global_names.claim(name.upper())
            return self.constants[name]

        return Code(_WORD.sub(word, written))

    @functools.cached_property
    def saved(self) -> frozenset[str]:
        """The layers whose outputs a `selective` checkpoint keeps, by path: only they are
        named (`checkpoint_name`), which is what the checkpoint's policy reads."""
        return frozenset(
            path
            for node in ir.walk(self.program.nodes)
            if isinstance(node, ir.Block) and node.remat.policy == "selective"
            for path in node.remat.saved
        )

    def seen(self, t: ir.TensorType) -> str:
        """`t` as the code holds it: a slice of the batch where the step slices it (gradient
        accumulation, a pipeline's microbatches), else as the spec types it."""
        p = self.program.pipeline
        slices = self.program.train.accumulate * (p.microbatches if p is not None and self.program.pipelined else 1)
        batch = self.program.input(self.program.stream).type.shape[0] if self.program.inputs else 0
        if slices > 1 and t.rank and t.shape[0] == batch and batch % slices == 0:
            t = ir.TensorType(t.dtype, (batch // slices, *t.shape[1:]), t.sharding)
        return t.describe()

    def where(self, span: ir.Span, text: bool = True) -> str:
        if span.line <= 0:
            return self.file
        here = f"{self.file}:{span.line}"
        if not text or span.line > len(self.source_lines):
            return here
        return comment(f"{here}  {self.source_lines[span.line - 1]}", COMMENT_WIDTH)

    # ---- one class ----------------------------------------------------------------------------------

    def module_class(
        self, name: str, doc: str, source: str, nodes: tuple[ir.Node, ...], base: str | None, remat: str = "none"
    ) -> ModuleClass:
        """A class whose `__call__` runs `nodes`; `base` is the block's path (None at top level,
        where weights are keyed by their stored names); `remat` the block's checkpointing."""
        cls = ModuleClass(name, doc, source, remat=remat, is_block=base is not None)
        self.statements(cls, nodes, "x", base, attribute_namer(), depth=0)
        return cls

    def path(self, full: str, base: str | None) -> Path:
        if base is None:
            return Path(full, False)
        assert full.startswith(base + "."), (full, base)
        return Path(full[len(base) :], True)

    def key(self, full: str, base: str | None) -> str:
        """The key of a weight (or a prefix of keys) in the class's dict: relative to the
        block, with `*` after each repeat's name (`blocks.*.attn.q`)."""
        return full[len(base) + 1 :] if base is not None else full

    def statements(
        self, cls: ModuleClass, nodes: tuple[ir.Node, ...], var: str, base: str | None, attrs: Namer, depth: int
    ) -> None:
        for node in nodes:
            match node:
                case ir.Layer():
                    cls.statements.append(self.layer(cls, node, var, base, attrs))
                case ir.Residual():
                    inner = "h" if depth == 0 else f"h{depth + 1}"
                    cls.statements.append(Statement("copy", inner, self.where(node.span, text=False), other=var))
                    self.statements(cls, node.body, inner, base, attrs, depth + 1)
                    cls.statements.append(Statement("add", var, other=inner))
                case ir.Branches():
                    arms = tuple(f"{var}_{i + 1}" for i in range(len(node.arms)))
                    for arm, arm_var, at in zip(node.arms, arms, node.arm_spans, strict=True):
                        cls.statements.append(Statement("branch", arm_var, self.where(at, text=False), other=var))
                        self.statements(cls, arm, arm_var, base, attrs, depth)
                    cls.statements.append(Statement("sum", var, others=arms))
                case ir.Stream():
                    # Its own variable (a suffix no other local has); kept among the inputs,
                    # where the layers reading it find it by name.
                    stream = f"{node.path}_stream"
                    cls.statements.append(Statement("stream", stream, self.where(node.span), other=node.source))
                    self.statements(cls, node.body, stream, base, attrs, depth)
                    cls.statements.append(Statement("keep", stream, other=node.path))
                case ir.Block():
                    attr = attrs.claim(_label(node.path, base))
                    cls.attributes.append(
                        Attribute(
                            "block",
                            attr,
                            self.where(node.span),
                            cls=self.block_class(node),
                            prefix=self.key(node.path, base) + ".",
                            path=self.path(node.path, base),
                        )
                    )
                    cls.statements.append(Statement("block", var, self.where(node.span), attribute=attr))
                case ir.Repeat():
                    attr = attrs.claim(_label(node.path, base))
                    cls.attributes.append(
                        Attribute(
                            "layers",
                            attr,
                            self.where(node.span),
                            cls=self.block_class(node.body),
                            prefix=self.key(node.path, base) + ".*.",
                            path=self.path(node.path, base),
                        )
                    )
                    # A pipeline chunk's share of the run is a number of its own.
                    whole = node.written and node.count == node.length
                    count = (self.code(node.written) if whole else None) or node.count
                    cls.statements.append(Statement("scan", var, self.where(node.span), attribute=attr, count=count))
                case ir.Layout():
                    cls.statements.append(
                        Statement("layout", var, self.where(node.span), sharding=node.output.sharding)
                    )

    def layer(self, cls: ModuleClass, layer: ir.Layer, var: str, base: str | None, attrs: Namer) -> Statement:
        rule = RULES[layer.kind]
        weights: tuple[WeightArg, ...] = ()
        if layer.weights:
            attr = attrs.claim(_label(layer.path, base))
            prefix = self.key(layer.path, base)
            cls.attributes.append(
                Attribute(
                    "weights",
                    attr,
                    self.where(layer.span),
                    # A tied weight is the stored array it reads (ties are made at the top level,
                    # where keys are the stored names).
                    weights=tuple(
                        (w.name, w.tie.name if w.tie is not None else f"{prefix}.{w.name}") for w in layer.weights
                    ),
                )
            )
            # Only parameters stored split over the data axes are gathered where they are used:
            # any other constraint would copy the weight, and autodiff would keep the copy.
            gather = self.program.train.zero >= 3
            weights = tuple(
                WeightArg(
                    attr,
                    w.name,
                    w.stored.type.sharding if gather else None,
                    w.tie is not None and w.tie.transposed,
                )
                for w in layer.weights
            )
        kernel, static = kernel_call(layer, ir.DTYPES[self.program.train.compute_dtype].jax)
        if cls.remat == "core_attention" and rule.core_flops(layer):
            static["recompute_core"] = True
        # A static argument that is the argument the spec wrote, unchanged, by the constants
        # the spec wrote it in.
        bound, written = dict(layer.attrs), dict(layer.written)

        def spelled(argument: str, value: object) -> object:
            given = bound.get(argument)
            if argument in written and type(given) is type(value) and given == value:
                return self.code(written[argument]) or value
            return value

        for keyword, value in static.items():
            if isinstance(value, BoundKernel):
                passes = dict(value.passes)
                keywords = tuple((k, spelled(passes[k], v) if k in passes else v) for k, v in value.keywords)
                static[keyword] = dataclasses.replace(value, keywords=keywords)
            else:
                static[keyword] = spelled(keyword, value)
        return Statement(
            "layer",
            var,
            self.where(layer.span),
            kernel=kernel,
            operand=layer.operand if layer.operand != layer.input.sharding else None,
            weights=weights,
            inputs=tuple(input_args(rule, dict(layer.attrs)).items()),
            key=self.path(layer.path, base) if rule.random else None,
            static=tuple(static.items()),
            output=layer.output.sharding if layer.output.rank else None,
            shape=self.seen(layer.output),
            path=self.path(layer.path, base) if layer.path in self.saved else None,
            has_aux=rule.has_aux,
        )

    # ---- block classes --------------------------------------------------------------------------

    def block_class(self, block: ir.Block) -> str:
        """The class for a block use: one per distinct body (a block used with different
        arguments gets a class per variant)."""
        key = signature(block)
        if key in self._block_classes:
            return self._block_classes[key]
        name = self.global_names.claim(class_name(block.block))
        self._block_classes[key] = name
        lines = [n.span.line for n in ir.walk(block.body) if n.span.line > 0]
        source = f"{self.file}:{min(lines)}-{max(lines)}" if lines else self.file
        doc = f"Block `{block.block}` of the spec."
        cls = self.module_class(name, doc, source, block.body, block.path, block.remat.policy)
        cls.saved = tuple(self.path(p, block.path) for p in block.remat.saved)
        self.blocks.append(cls)
        return name


def kernel_call(layer: ir.Layer, dtype: str) -> tuple[str, dict[str, object]]:
    """The kernel a layer calls and its static keyword arguments, computing in `dtype`."""
    rule = RULES[layer.kind]
    a = rule.args_of(layer)
    weights = {w.name: w.type.sharding for w in layer.weights}
    static = rule.kernel_args(a, dtype, layer.operand, weights) | rule.sized_args(a, layer.input, layer.operand)
    return rule.kernel(a, layer.operand), static


def _label(path: str, base: str | None) -> str:
    """The name a node has in its class: its path relative to the enclosing block."""
    rel = path[len(base) + 1 :] if base is not None and path.startswith(base + ".") else path
    return rel.replace(".", "_")
