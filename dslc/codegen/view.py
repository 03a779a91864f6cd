"""What the templates print: the checked IR arranged as a Python module's parts.

Plain data, decided here so the templates only print: which classes there are (one per
distinct block, one per pipeline chunk or one for the whole model), their attributes, and
each `__call__` as a flat list of statements. Every statement mirrors one step of the
direct backend's interpreter (`dslc.lower.model`) in the same order, which is what makes
the two backends compute the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dslc.codegen.names import Namer, attribute_namer, class_name, comment
from dslc.ir import nodes as ir
from dslc.ir.repeats import group_repeats, signature
from dslc.layers import LOSS_KINDS, RULES
from dslc.layers.base import input_args

# Comments carry the spec line they came from, cut to stay within the line length.
COMMENT_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Path:
    """A layer's dotted name, as code: relative to the enclosing block's `self.path`, or absolute."""

    text: str
    in_block: bool


@dataclass(frozen=True, slots=True)
class WeightArg:
    keyword: str
    attribute: str
    name: str
    sharding: ir.Sharding


@dataclass(frozen=True, slots=True)
class Statement:
    kind: Literal["layer", "copy", "add", "layout", "block", "scan", "loss"]
    var: str
    source: str = ""  # where it was written: "gpt_small.par:24  attn: attention(...)"
    # layer / loss
    kernel: str = ""
    operand: ir.Sharding | None = None  # constrain the input first (sequence-parallel gathers)
    weights: tuple[WeightArg, ...] = ()
    inputs: tuple[tuple[str, str], ...] = ()  # keyword, model input name
    key: Path | None = None  # the layer draws random numbers keyed by this path
    static: tuple[tuple[str, object], ...] = ()
    output: ir.Sharding | None = None
    path: Path | None = None
    # copy / add: the other variable; layout: the sharding
    other: str = ""
    sharding: ir.Sharding = ()
    # block / scan
    attribute: str = ""
    # layer: its kernel returns (y, auxiliary values)
    has_aux: bool = False


@dataclass(frozen=True, slots=True)
class Attribute:
    """`self.NAME = ...` in `__init__`."""

    kind: Literal["weights", "block", "blocks"]
    name: str
    weights: tuple[tuple[str, Path], ...] = ()  # weight name, its parameter's dotted name
    cls: str = ""
    paths: tuple[Path, ...] = ()  # the block's (blocks') own path
    source: str = ""


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


@dataclass
class Builder:
    program: ir.Program
    source_lines: list[str]
    file: str
    global_names: Namer
    blocks: list[ModuleClass] = field(default_factory=list)
    _block_classes: dict[object, str] = field(default_factory=dict)

    def where(self, span: ir.Span, text: bool = True) -> str:
        if span.line <= 0:
            return self.file
        here = f"{self.file}:{span.line}"
        if not text or span.line > len(self.source_lines):
            return here
        return comment(f"{here}  {self.source_lines[span.line - 1]}", COMMENT_WIDTH)

    # ---- one class ----------------------------------------------------------------------------------

    def module_class(
        self, name: str, doc: str, source: str, nodes: tuple[ir.Node, ...], base: str | None
    ) -> ModuleClass:
        """A class whose `__call__` runs `nodes`; `base` is the block's path (None at top level)."""
        cls = ModuleClass(name, doc, source, is_block=base is not None)
        attrs = attribute_namer()
        self.statements(cls, nodes, "x", base, attrs, depth=0)
        return cls

    def path(self, full: str, base: str | None) -> Path:
        if base is None:
            return Path(full, False)
        assert full.startswith(base + "."), (full, base)
        return Path(full[len(base) :], True)

    def statements(
        self, cls: ModuleClass, nodes: tuple[ir.Node, ...], var: str, base: str | None, attrs: Namer, depth: int
    ) -> None:
        for run in group_repeats(nodes):
            node = run[0]
            if len(run) > 1:
                assert isinstance(node, ir.Block)
                attr = attrs.claim(_label(_run_name(node.path), base))
                cls.attributes.append(
                    Attribute(
                        "blocks",
                        attr,
                        cls=self.block_class(node),
                        paths=tuple(self.path(b.path, base) for b in run),
                        source=self.where(node.span),
                    )
                )
                cls.statements.append(Statement("scan", var, self.where(node.span), attribute=attr))
                continue
            match node:
                case ir.Layer():
                    cls.statements.append(self.layer(cls, node, var, base, attrs))
                case ir.Residual():
                    inner = "h" if depth == 0 else f"h{depth + 1}"
                    cls.statements.append(Statement("copy", inner, self.where(node.span, text=False), other=var))
                    self.statements(cls, node.body, inner, base, attrs, depth + 1)
                    cls.statements.append(Statement("add", var, other=inner))
                case ir.Block():
                    attr = attrs.claim(_label(node.path, base))
                    cls.attributes.append(
                        Attribute(
                            "block",
                            attr,
                            cls=self.block_class(node),
                            paths=(self.path(node.path, base),),
                            source=self.where(node.span),
                        )
                    )
                    cls.statements.append(Statement("block", var, self.where(node.span), attribute=attr))
                case ir.Layout():
                    cls.statements.append(
                        Statement("layout", var, self.where(node.span), sharding=node.output.sharding)
                    )

    def layer(self, cls: ModuleClass, layer: ir.Layer, var: str, base: str | None, attrs: Namer) -> Statement:
        rule = RULES[layer.kind]
        weights: tuple[WeightArg, ...] = ()
        if layer.weights:
            attr = attrs.claim(_label(layer.path, base))
            cls.attributes.append(
                Attribute(
                    "weights",
                    attr,
                    weights=tuple((w.name, self.path(f"{layer.path}.{w.name}", base)) for w in layer.weights),
                    source=self.where(layer.span),
                )
            )
            weights = tuple(WeightArg(w.name, attr, w.name, w.type.sharding) for w in layer.weights)
        a = dict(layer.attrs)
        dtype = JAX_DTYPE_NAMES[self.program.train.compute_dtype]
        static = rule.kernel_args(a, dtype, layer.operand, {w.name: w.type.sharding for w in layer.weights})
        return Statement(
            "loss" if layer.kind in LOSS_KINDS else "layer",
            var,
            self.where(layer.span),
            kernel=rule.kernel(a, layer.operand),
            operand=layer.operand if layer.operand != layer.input.sharding else None,
            weights=weights,
            inputs=tuple(input_args(rule, a).items()),
            key=self.path(layer.path, base) if rule.random else None,
            static=tuple(static.items()),
            output=layer.output.sharding if layer.output.rank else None,
            path=self.path(layer.path, base),
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
        cls = self.module_class(name, doc, source, block.body, block.path)
        cls.remat = block.remat.policy
        if block.remat.policy == "selective":
            prefix = block.path + "."
            cls.saved = tuple(
                self.path(n.path, block.path)
                for n in ir.walk(block.body)
                if n.path[len(prefix) :] in block.remat.saved or n.path.rsplit(".", 1)[-1] in block.remat.saved
            )
        self.blocks.append(cls)
        return name


def _run_name(path: str) -> str:
    """A repeat's name: `layers` for the run `layers.0`, `layers.1`, ..."""
    head, _, index = path.rpartition(".")
    return head if head and index.isdigit() else path


def _label(path: str, base: str | None) -> str:
    """The name a node has in its class: its path relative to the enclosing block."""
    rel = path[len(base) + 1 :] if base is not None and path.startswith(base + ".") else path
    return rel.replace(".", "_")


JAX_DTYPE_NAMES = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "f64": "float64",
    "i32": "int32",
    "i64": "int64",
    "i8": "int8",
    "bool": "bool",
}
