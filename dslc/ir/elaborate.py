"""Elaboration: from what was written (AST) to what it means (IR).

Runs in the order a reader resolves a spec: the header (model, mesh, constants, inputs,
training settings), then the forward body — blocks instantiated, repeats expanded, each
layer's arguments bound and its output typed by its layer rule — then the pipeline, which
cuts the body into chunks. Every problem is reported where it was written and elaboration
goes on, so one run finds them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from dslc.diagnostics import NO_SPAN, Diagnostic, Diagnostics, Label, Span
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue, eval_expr, eval_value
from dslc.ir.names import closest, unknown_name
from dslc.ir.settings import read_pipeline, read_train
from dslc.ir.shardings import divisor_sizes, resolve
from dslc.ir.ties import Declared, tied_weight
from dslc.ir.vocabulary import feeding_masked_losses, pad
from dslc.layers import LOSS_KINDS, RULES
from dslc.layers.base import REQUIRED, ArgSpec, Context, LayerRule, Vocabulary, input_args
from dslc.schedules import ScheduleError, placement
from dslc.syntax import ast

# A typed IR needs a type for the activation after a layer that could not be typed; this
# marks it, and layers that receive it are not typed (which would only repeat the error).
UNKNOWN = ir.TensorType("unknown", (), ())
CHECKPOINT_POLICIES = ("none", "full", "selective", "core_attention")

MAX_REPEAT = 4096
MAX_NODES = 200_000
DTYPES = tuple(ir.DTYPE_BYTES)


def elaborate(
    module: ast.Module,
    mesh_sizes: Sequence[int] | None,
    diags: Diagnostics,
    overrides: Mapping[str, ScalarValue] | None = None,
) -> ir.Program | None:
    """The program a module denotes, or None when it is too broken to say.

    `overrides` replaces the values of named constants (`--set layers=4`); constants defined
    from them follow.
    """
    if not module.items:
        diags.error(
            "E028",
            "the spec is empty",
            module.span,
            help="a spec needs at least `model NAME`, an `input` and a `forward(INPUT) { ... }` body",
        )
        return None
    header = _Header.read(module, mesh_sizes, diags, overrides or {})
    if header.forward is None:
        # Where the body would go: after the last item. (Not the whole file, which is where a
        # missing `model` is reported: one report per code and span is kept.)
        last = module.items[-1].span
        diags.error(
            "E028",
            "the spec has no `forward(...) { ... }` body",
            Span(last.file, last.end_line, last.end_column, last.end_line, last.end_column + 1),
            help="add `forward(INPUT) { ...layers... }` naming the input the layers read",
        )
        return None
    builder = _Builder(header, diags)
    chunks_source = builder.forward(header.forward)
    if chunks_source is None:
        return None
    stream, segments = chunks_source
    pipeline = read_pipeline(header.pipeline, header.mesh, header.constants, diags) if header.pipeline else None
    if header.pipeline is not None and pipeline is None:
        # The pipeline was declared but could not be read (already reported): the stages
        # cannot be counted against it, and "no pipeline is declared" would be untrue.
        chunks: tuple[ir.Chunk, ...] = (ir.Chunk(0, 0, 0, tuple(n for s in segments for n in s.nodes)),)
    else:
        chunks = _assign_chunks(segments, pipeline, header, diags, builder.misplaced_stages)
    final = chunks[-1].nodes[-1] if chunks and chunks[-1].nodes else None
    return ir.Program(
        name=header.name,
        mesh=header.mesh,
        constants=tuple(header.constants.items()),
        inputs=tuple(header.inputs.values()),
        stream=stream,
        chunks=chunks,
        pipeline=pipeline,
        train=header.train,
        loss=final if isinstance(final, ir.Layer) and final.kind in LOSS_KINDS else None,
        span=module.span,
    )


# ---- the header ------------------------------------------------------------------------------


@dataclass
class _Header:
    name: str
    mesh: ir.Mesh
    constants: dict[str, ScalarValue]
    inputs: dict[str, ir.Input]
    blocks: dict[str, ast.BlockDef]
    forward: ast.ForwardDef | None
    pipeline: ast.PipelineDef | None
    train: ir.Train
    # Inputs whose dtype or shape could not be read (already reported): they stand in the IR
    # with placeholder sizes, so the layers they feed are not typed (that would only report
    # the placeholder).
    untyped_inputs: set[str] = field(default_factory=set)
    # Those and the inputs whose sharding was refused (its bad axes dropped): a loss does not
    # compare its targets' sharding with the activation's when either was mis-declared.
    broken_inputs: set[str] = field(default_factory=set)

    @property
    def pipeline_axis(self) -> str | None:
        return self.pipeline.axis.text if self.pipeline else None

    @staticmethod
    def read(
        module: ast.Module,
        mesh_sizes: Sequence[int] | None,
        diags: Diagnostics,
        overrides: Mapping[str, ScalarValue],
    ) -> _Header:
        singles: dict[type, ast.Item] = {}
        for item in module.items:
            if isinstance(item, (ast.ModelDecl, ast.MeshDecl, ast.ForwardDef, ast.PipelineDef, ast.TrainDef)):
                first = singles.setdefault(type(item), item)
                if first is not item:
                    keyword = _KEYWORD[type(item)]
                    diags.error(
                        "E011",
                        f"a spec has one `{keyword}` declaration",
                        item.span,
                        labels=[Label(first.span, "first declared here")],
                    )
        model = singles.get(ast.ModelDecl)
        if model is None:
            diags.error(
                "E028",
                "the spec has no `model NAME` declaration",
                module.span,
                help="start the file with `model my_model`",
            )
        name = model.name.text if isinstance(model, ast.ModelDecl) else "model"
        mesh_decl = singles.get(ast.MeshDecl)
        mesh = _read_mesh(mesh_decl if isinstance(mesh_decl, ast.MeshDecl) else None, mesh_sizes, module, diags)
        pipeline = singles.get(ast.PipelineDef)
        pipeline_def = pipeline if isinstance(pipeline, ast.PipelineDef) else None
        constants = read_constants(module, overrides, diags)
        header = _Header(
            name=name,
            mesh=mesh,
            constants=constants,
            inputs={},
            blocks={},
            forward=singles.get(ast.ForwardDef),  # type: ignore[arg-type]
            pipeline=pipeline_def,
            train=ir.Train(),
        )
        train = singles.get(ast.TrainDef)
        header.train = read_train(train, mesh, constants, diags) if isinstance(train, ast.TrainDef) else ir.Train()
        header.inputs = _read_inputs(module, header, diags)
        header.blocks = _read_blocks(module, diags)
        return header


_KEYWORD = {
    ast.ModelDecl: "model",
    ast.MeshDecl: "mesh",
    ast.ForwardDef: "forward",
    ast.PipelineDef: "pipeline",
    ast.TrainDef: "train",
}


def _read_mesh(
    decl: ast.MeshDecl | None, sizes: Sequence[int] | None, module: ast.Module, diags: Diagnostics
) -> ir.Mesh:
    if decl is None:
        if sizes is not None and tuple(sizes) != (1,) * len(sizes):
            diags.error(
                "E023",
                f"--mesh {'x'.join(map(str, sizes))} was given, but the spec declares no mesh axes",
                module.span,
                help="declare the axes, for example `mesh data, model, stage`",
            )
        return ir.Mesh(())
    axes: list[ir.MeshAxis] = []
    seen: dict[str, ast.MeshAxis] = {}
    if sizes is not None and len(sizes) != len(decl.axes):
        names = ", ".join(a.name.text for a in decl.axes)
        diags.error(
            "E023",
            f"--mesh {'x'.join(map(str, sizes))} gives {_count(len(sizes), 'size')}, but the spec's mesh has "
            f"{_count(len(decl.axes), 'axis', 'axes')} ({names})",
            decl.span,
            help=f"pass one size per axis, in order: --mesh {'x'.join('N' for _ in decl.axes)}",
        )
        sizes = None
    for i, axis in enumerate(decl.axes):
        if axis.name.text in seen:
            diags.error(
                "E011",
                f"mesh axis `{axis.name.text}` is declared twice",
                axis.name.span,
                labels=[Label(seen[axis.name.text].span, "first declared here")],
            )
            continue
        seen[axis.name.text] = axis
        size: int | None
        if sizes is not None:
            size = sizes[i]
        elif axis.size is not None:
            size = eval_expr(axis.size, {}, diags)
        else:
            diags.error(
                "E023",
                f"mesh axis `{axis.name.text}` has no size",
                axis.span,
                help=f"give a default in the spec (`{axis.name.text}=2`) or pass --mesh",
            )
            size = 1
        if size is not None and size < 1:
            diags.error("E023", f"mesh axis `{axis.name.text}` must have a size of at least 1, got {size}", axis.span)
            size = 1
        axes.append(ir.MeshAxis(axis.name.text, size or 1, axis.span))
    return ir.Mesh(tuple(axes))


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def read_constants(
    module: ast.Module, overrides: Mapping[str, ScalarValue], diags: Diagnostics
) -> dict[str, ScalarValue]:
    """The value of every constant the module defines (integers, numbers with a fraction,
    booleans), `overrides` replacing the values written."""
    decls = [item for item in module.items if isinstance(item, ast.ConstDecl)]
    values: dict[str, ScalarValue] = {}
    spans: dict[str, Span] = {}
    declared_at = {d.name.text: d.name.span for d in decls}
    for decl in decls:
        name = decl.name.text
        if name in spans:
            diags.error(
                "E011",
                f"constant `{name}` is defined twice",
                decl.name.span,
                labels=[Label(spans[name], "first defined here")],
            )
            continue
        spans[name] = decl.name.span
        later = {n: s for n, s in declared_at.items() if n not in values and n != name}
        local = Diagnostics()
        value = overrides[name] if name in overrides else eval_value(decl.value, values, local)
        for d in local.items:
            diags.add(_explain_later(d, later))
        if value is not None:
            values[name] = value
    return values


def _explain_later(d: Diagnostic, later: dict[str, Span]) -> Diagnostic:
    """An unknown constant that is declared further down gets a label saying so."""
    if d.code != "E010":
        return d
    name = d.message.split("`")[1]
    if name in later:
        return Diagnostic(
            d.severity,
            d.code,
            f"constant `{name}` is used before it is defined",
            d.span,
            (Label(later[name], "defined here"),),
            (),
            "move the definition above its first use",
        )
    return d


def _read_inputs(module: ast.Module, header: _Header, diags: Diagnostics) -> dict[str, ir.Input]:
    inputs: dict[str, ir.Input] = {}
    for decl in (i for i in module.items if isinstance(i, ast.InputDecl)):
        name = decl.name.text
        if name in inputs:
            diags.error(
                "E011",
                f"input `{name}` is declared twice",
                decl.name.span,
                labels=[Label(inputs[name].span, "first declared here")],
            )
            continue
        t = decl.type
        dtype = t.dtype.text
        if dtype not in DTYPES:
            diags.add(unknown_name("dtype", dtype, t.dtype.span, DTYPES))
            dtype = "f32"
            header.untyped_inputs.add(name)
        sizes: list[int | None] = []
        for dim in t.dims:
            size = eval_expr(dim.size, header.constants, diags)
            if size is not None and size < 1:
                diags.error("E025", f"dimensions must be positive, got {size}", dim.size.span)
                size = None
            if size is None:
                header.untyped_inputs.add(name)
            sizes.append(size)
        reported = len(diags.items)
        sharding = resolve(
            [dim.sharding or ast.AxisSet((), dim.span) for dim in t.dims],
            sizes,
            f"input `{name}`",
            header.mesh,
            header.pipeline_axis,
            diags,
        )
        if name in header.untyped_inputs or len(diags.items) > reported:
            header.broken_inputs.add(name)
        shape = tuple(size or 1 for size in sizes)
        inputs[name] = ir.Input(name, ir.TensorType(dtype, shape, sharding), decl.span)
    return inputs


def _read_blocks(module: ast.Module, diags: Diagnostics) -> dict[str, ast.BlockDef]:
    blocks: dict[str, ast.BlockDef] = {}
    for block in (i for i in module.items if isinstance(i, ast.BlockDef)):
        name = block.name.text
        if name in RULES:
            diags.error(
                "E011", f"block `{name}` has the name of a built-in layer", block.name.span, help="rename the block"
            )
        elif name in blocks:
            diags.error(
                "E011",
                f"block `{name}` is defined twice",
                block.name.span,
                labels=[Label(blocks[name].name.span, "first defined here")],
            )
        else:
            blocks[name] = block
        params: dict[str, ast.Param] = {}
        for p in block.params:
            if p.name.text in params:
                diags.error("E011", f"parameter `{p.name.text}` is declared twice", p.name.span)
            params[p.name.text] = p
    return blocks


# ---- the body --------------------------------------------------------------------------------

Scope = dict[str, ScalarValue]


@dataclass
class _Segment:
    """A top-level run of the forward body: loose layers, one `stage`, or a `stages` region."""

    kind: str  # "loose" | "stage" | "stages"
    nodes: list[ir.Node]
    span: Span


@dataclass
class _Flow:
    """The activation flowing through a sequence: its type and where it was produced."""

    type: ir.TensorType
    span: Span
    after_loss: Span | None = None
    # The classes of logits whose last dimension a padded vocabulary widened (the loss masks
    # the rest out); None where nothing is padded.
    classes: int | None = None


class _Builder:
    def __init__(self, header: _Header, diags: Diagnostics) -> None:
        self.h = header
        self.diags = diags
        self.block_stack: list[str] = []
        self.count = 0
        self.too_big = False
        self.misplaced_stages = False
        self.stream = ""
        # Every weight elaborated so far, by dotted name: what a `tie` may name.
        self.declared: dict[str, Declared] = {}
        # Blocks and repeats the statement being elaborated is inside, and of those repeats.
        self.depth = 0
        self.repeats = 0
        # The calls of heads right before a loss that masks padded logits (by id).
        self.heads: set[int] = set()

    # entry ---------------------------------------------------------------------------------------

    def forward(self, fwd: ast.ForwardDef) -> tuple[str, list[_Segment]] | None:
        stream = fwd.input.text
        self.stream = stream
        if stream not in self.h.inputs:
            self.diags.add(unknown_name("input", stream, fwd.input.span, self.h.inputs))
            return None
        src = self.h.inputs[stream]
        flow = _Flow(UNKNOWN if stream in self.h.untyped_inputs else src.type, src.span)
        self.heads = feeding_masked_losses(fwd.body)
        names = self._names(fwd.body)
        segments: list[_Segment] = []
        scope: Scope = dict(self.h.constants)
        for stmt in fwd.body:
            match stmt:
                case ast.StageStmt(body=body) | ast.StagesStmt(body=body):
                    kind = "stage" if isinstance(stmt, ast.StageStmt) else "stages"
                    nodes = self._seq(body, flow, scope, "", names)
                    segments.append(_Segment(kind, nodes, stmt.span))
                case _:
                    nodes = self._seq((stmt,), flow, scope, "", names)
                    if segments and segments[-1].kind == "loose":
                        segments[-1].nodes.extend(nodes)
                    else:
                        segments.append(_Segment("loose", nodes, stmt.span))
        return stream, segments

    # naming ------------------------------------------------------------------------------------

    def _names(self, stmts: Sequence[ast.Stmt]) -> dict[int, str]:
        """Names for the statements of one scope. Unlabelled statements are named after what
        they call (`gelu`, or `gelu_0`, `gelu_1` when there are several); `residual`, `stage`
        and `stages` without a label are transparent and share their parent's scope."""
        named: list[ast.Stmt] = []

        def collect(body: Sequence[ast.Stmt]) -> None:
            for s in body:
                match s:
                    case ast.StageStmt(body=inner) | ast.StagesStmt(body=inner):
                        collect(inner)
                    case ast.ResidualStmt(label=None, body=inner):
                        collect(inner)
                    case ast.LayoutStmt():
                        pass
                    case _:
                        named.append(s)

        collect(stmts)
        labels: dict[str, ast.Ident] = {}
        for s in named:
            label = getattr(s, "label", None)
            if label is not None:
                if label.text in labels:
                    self.diags.error(
                        "E011",
                        f"`{label.text}` names two layers in the same scope",
                        label.span,
                        labels=[Label(labels[label.text].span, "first used here")],
                    )
                labels.setdefault(label.text, label)
        bases: dict[int, str] = {}
        for s in named:
            if getattr(s, "label", None) is None:
                match s:
                    case ast.LayerStmt(call=call) | ast.RepeatStmt(call=ast.Call() as call):
                        bases[id(s)] = call.callee.text
                    case _:
                        bases[id(s)] = "repeat" if isinstance(s, ast.RepeatStmt) else "residual"
        counts: dict[str, int] = {}
        for base in bases.values():
            counts[base] = counts.get(base, 0) + 1
        out: dict[int, str] = {}
        used = set(labels)
        index: dict[str, int] = {}
        for s in named:
            label = getattr(s, "label", None)
            if label is not None:
                out[id(s)] = label.text
                continue
            base = bases[id(s)]
            if counts[base] == 1 and base not in used:
                name = base
            else:
                name = f"{base}_{index.get(base, 0)}"
                while name in used:
                    index[base] = index.get(base, 0) + 1
                    name = f"{base}_{index[base]}"
                index[base] = index.get(base, 0) + 1
            used.add(name)
            out[id(s)] = name
        return out

    # sequences ---------------------------------------------------------------------------------

    def _seq(
        self, stmts: Sequence[ast.Stmt], flow: _Flow, scope: Scope, prefix: str, names: dict[int, str]
    ) -> list[ir.Node]:
        out: list[ir.Node] = []
        for stmt in stmts:
            if self.too_big:
                break
            if flow.after_loss is not None and not isinstance(stmt, (ast.LayoutStmt,)):
                self.diags.error(
                    "E028",
                    "layers after the loss are never reached",
                    stmt.span,
                    labels=[Label(flow.after_loss, "the loss ends the forward pass here")],
                )
                flow.after_loss = None
            match stmt:
                case ast.LayerStmt():
                    node = self._use(
                        stmt.call, stmt.shards, names[id(stmt)], flow, scope, prefix, stmt.span, ties=stmt.ties
                    )
                    if node is not None:
                        out.append(node)
                case ast.ResidualStmt():
                    out.append(self._residual(stmt, flow, scope, prefix, names))
                case ast.RepeatStmt():
                    out.extend(self._repeat(stmt, names[id(stmt)], flow, scope, prefix))
                case ast.LayoutStmt():
                    layout = self._layout(stmt, flow, prefix)
                    last = out[-1] if out else None
                    if isinstance(last, ir.Layer):
                        out[-1] = _fuse_reduce_scatter(last, layout)
                    out.append(layout)
                case ast.StageStmt() | ast.StagesStmt():
                    keyword = "stage" if isinstance(stmt, ast.StageStmt) else "stages"
                    self.misplaced_stages = True
                    self.diags.error(
                        "E028",
                        f"`{keyword}` marks pipeline chunks and may only appear at the top of `forward`",
                        stmt.span,
                    )
                    out.extend(self._seq(stmt.body, flow, scope, prefix, names))
        return out

    def _residual(
        self, stmt: ast.ResidualStmt, flow: _Flow, scope: Scope, prefix: str, names: dict[int, str]
    ) -> ir.Node:
        path = prefix + names[id(stmt)] if stmt.label else prefix.rstrip(".") or "residual"
        inner_prefix = prefix + stmt.label.text + "." if stmt.label else prefix
        inner_names = self._names(stmt.body) if stmt.label else names
        x = flow.type
        body = self._seq(stmt.body, flow, scope, inner_prefix, inner_names)
        y = flow.type
        if x is not UNKNOWN and y is not UNKNOWN:
            if y.shape != x.shape:
                self.diags.error(
                    "E016",
                    f"a residual branch must keep its input's shape, but it turns {x.describe()} into {y.describe()}",
                    stmt.span,
                    labels=[Label(flow.span, "branch output produced here")],
                )
            elif y.sharding != x.sharding:
                self.diags.error(
                    "E017",
                    "a residual branch must keep its input's sharding, "
                    f"but it turns {x.describe()} into {y.describe()}",
                    stmt.span,
                    labels=[Label(flow.span, "branch output produced here")],
                    help="end the branch with a row-parallel layer, or add `layout` to restore the sharding",
                )
        out_type = x if x is not UNKNOWN else UNKNOWN
        flow.type, flow.span = out_type, stmt.span
        return ir.Residual(path, tuple(body), x, out_type, stmt.span)

    def _repeat(self, stmt: ast.RepeatStmt, name: str, flow: _Flow, scope: Scope, prefix: str) -> list[ir.Node]:
        """A run of one block, elaborated once: the block must hand the next copy what it
        received (the same type), so every copy computes the same function of its own weights.
        A block that changes its input's type cannot loop; its copies are elaborated one by
        one instead (each names its layers `NAME.i.…`, as a loop's would be named)."""
        count = eval_expr(stmt.count, scope, self.diags)
        if count is None:
            return []
        if not 1 <= count <= MAX_REPEAT:
            self.diags.error("E024", f"repeat count must be between 1 and {MAX_REPEAT}, got {count}", stmt.count.span)
            return []
        x = flow.type
        start = _Flow(flow.type, flow.span, flow.after_loss)
        body = self._repeat_body(stmt, f"{prefix}{name}", name, flow, scope, prefix)
        if body is None:
            return []
        if count == 1 or x is UNKNOWN or body.output == x:
            return [ir.Repeat(f"{prefix}{name}", body, count, span=stmt.span)]
        flow.type, flow.span, flow.after_loss = start.type, start.span, start.after_loss
        out: list[ir.Node] = []
        for i in range(count):
            block = self._repeat_body(stmt, f"{prefix}{name}.{i}", f"{name}.{i}", flow, scope, prefix, quiet=i > 0)
            if block is None:
                break
            out.append(block)
        return out

    def _repeat_body(
        self, stmt: ast.RepeatStmt, path: str, name: str, flow: _Flow, scope: Scope, prefix: str, quiet: bool = False
    ) -> ir.Block | None:
        """One copy of a repeat's block at `path`: the block it calls, or its written body; a
        repeated built-in layer is wrapped in a block of its own."""
        x = flow.type
        self.depth += 1
        self.repeats += 1
        try:
            if stmt.call is not None:
                node = self._use(stmt.call, (), name, flow, scope, prefix, stmt.span, quiet=quiet)
                if node is None:
                    return None
                if isinstance(node, ir.Block):
                    return node
                return ir.Block(path, stmt.call.callee.text, ir.Remat(), (node,), x, flow.type, stmt.span)
            body = self._seq(stmt.body, flow, scope, path + ".", self._names(stmt.body))
            return ir.Block(path, "repeat", ir.Remat(), tuple(body), x, flow.type, stmt.span)
        finally:
            self.depth -= 1
            self.repeats -= 1

    def _layout(self, stmt: ast.LayoutStmt, flow: _Flow, prefix: str) -> ir.Layout:
        x = flow.type
        path = prefix + "layout"
        if x is UNKNOWN:
            return ir.Layout(path, x, x, (), stmt.span)
        if len(stmt.dims) != x.rank:
            self.diags.error(
                "E016",
                f"`layout` gives {len(stmt.dims)} dimensions, but the activation here has {x.rank}: {x.describe()}",
                stmt.span,
                labels=[Label(flow.span, "activation produced here")],
            )
            return ir.Layout(path, x, x, (), stmt.span)
        sharding = resolve(stmt.dims, x.shape, "the activation", self.h.mesh, self.h.pipeline_axis, self.diags)
        y = ir.TensorType(x.dtype, x.shape, sharding)
        collectives = []
        for old, new in zip(x.sharding, y.sharding, strict=True):
            gone = tuple(a for a in old if a not in new)
            if gone and self.h.mesh.size(gone) > 1:
                collectives.append(
                    ir.Collective("all-gather", gone, x.numel, x.dtype, "`layout`: gather the activation")
                )
        flow.type, flow.span = y, stmt.span
        return ir.Layout(path, x, y, tuple(collectives), stmt.span)

    # one use of a layer or block ---------------------------------------------------------------------------

    def _use(
        self,
        call: ast.Call,
        shards: tuple[ast.WeightShard, ...],
        name: str,
        flow: _Flow,
        scope: Scope,
        prefix: str,
        span: Span,
        quiet: bool = False,
        ties: tuple[ast.WeightTie, ...] = (),
    ) -> ir.Node | None:
        self.count += 1
        if self.count > MAX_NODES:
            self.diags.error(
                "E025", f"the model expands to more than {MAX_NODES} layers", span, help="reduce repeat counts"
            )
            self.too_big = True
            return None
        callee = call.callee.text
        path = prefix + name
        if callee in RULES:
            return self._layer(RULES[callee], call, shards, ties, path, flow, scope, span)
        if callee in self.h.blocks:
            clauses: tuple[tuple[str, str, tuple[ast.WeightShard, ...] | tuple[ast.WeightTie, ...], str], ...] = (
                ("E027", "shard", shards, "put the `shard` on the layers inside the block"),
                ("E032", "tie", ties, "tie the weight of a layer written at the top of `forward`"),
            )
            for code, keyword, written, fix in clauses:
                if written:
                    message = f"`{keyword}` applies to the weights of a built-in layer, not to a block"
                    self.diags.error(code, message, written[0].span, help=fix)
            return self._block(self.h.blocks[callee], call, path, flow, scope)
        if not quiet:
            self.diags.add(unknown_name("layer or block", callee, call.callee.span, (*RULES, *self.h.blocks)))
            self._check_shard_axes(shards, path)
        flow.type = UNKNOWN
        return None

    def _layer(
        self,
        rule: LayerRule,
        call: ast.Call,
        shards: tuple[ast.WeightShard, ...],
        ties: tuple[ast.WeightTie, ...],
        path: str,
        flow: _Flow,
        scope: Scope,
        span: Span,
    ) -> ir.Node | None:
        arg_spans: dict[str, Span] = {}
        attrs = self._bind(rule.args, call, scope, f"`{rule.kind}`", spans=arg_spans)
        ctx = Context(
            mesh=self.h.mesh,
            path=path,
            span=call.span,
            input_span=flow.span,
            inputs=self.h.inputs,
            compute_dtype=self.h.train.compute_dtype,
            diags=self.diags,
            arg_spans=arg_spans,
        )
        if attrs is None or not rule.validate(attrs, ctx):
            self._check_shard_axes(shards, path)
            flow.type, flow.span = UNKNOWN, span
            return None
        if flow.classes is not None and "classes" in {a.name for a in rule.args} and "classes" not in arg_spans:
            # The loss after a padded head counts only the real classes.
            attrs["classes"] = flow.classes
        vocab = rule.vocabulary(attrs, id(call) in self.heads)
        weights = self._weights(rule, attrs, shards, ties, vocab, path, call.span, ctx)
        for w in weights or ():
            self.declared[f"{path}.{w.name}"] = Declared(w, self.repeats > 0)
        x = flow.type
        y = UNKNOWN
        # A layer that reads a declared input (a loss's targets) compares it with the
        # activation, which comes from the stream input. An unreadable target leaves nothing
        # to compare; a refused sharding on either side leaves shapes, but not shardings.
        reads = set(input_args(rule, attrs).values())
        if reads and (reads | {self.stream}) & self.h.broken_inputs:
            ctx.shardings_as_written = False
        if x is not UNKNOWN and weights is not None and not reads & self.h.untyped_inputs:
            typed = rule.infer(attrs, x, {w.name: w.type for w in weights}, ctx)
            y = typed if typed is not None else UNKNOWN
        node = ir.Layer(
            path=path,
            kind=rule.kind,
            attrs=tuple(attrs.items()),
            weights=tuple(weights or ()),
            input=x,
            output=y,
            collectives=tuple(ctx.collectives),
            flops=rule.flops(attrs, x, y) if y is not UNKNOWN else 0,
            operand=ctx.operand if ctx.operand is not None else x.sharding,
            span=span,
        )
        flow.type, flow.span = y, span
        widened = vocab is not None and vocab.logits and y is not UNKNOWN and y.shape[-1] != vocab.size
        flow.classes = vocab.size if vocab is not None and widened else None
        if rule.kind in LOSS_KINDS:
            flow.after_loss = span
        return node

    def _weights(
        self,
        rule: LayerRule,
        attrs: dict[str, object],
        shards: tuple[ast.WeightShard, ...],
        ties: tuple[ast.WeightTie, ...],
        vocab: Vocabulary | None,
        path: str,
        span: Span,
        ctx: Context,
    ) -> list[ir.Weight] | None:
        specs = {w.name: w for w in rule.weights(attrs)}
        # A vocabulary's dimensions are padded to split evenly rather than refused (below).
        padded = dict(vocab.dims) if vocab is not None else {}
        given: dict[str, ast.WeightShard] = {}
        ok = True
        for shard in shards:
            wname = shard.weight.text
            possible = rule.possible_weights(attrs)
            if wname not in specs and wname in possible:
                # A weight other arguments would give this use (a bias turned off): the clause
                # applies where it exists, so one spec can switch it with a constant.
                continue
            if wname not in specs:
                self._no_such_weight(rule, attrs, shard.weight, "E027", f"`{rule.kind}` has no weight `{wname}`")
                ok = False
            elif wname in given:
                self._twice("E027", f"weight `{wname}` is sharded twice", shard.span, given[wname].span, "sharded")
                ok = False
            elif len(shard.dims) != len(specs[wname].shape):
                dims = ", ".join(map(str, specs[wname].shape))
                self.diags.error(
                    "E027",
                    f"weight `{wname}` of `{rule.kind}` has {len(specs[wname].shape)} dimensions [{dims}], "
                    f"but the clause gives {len(shard.dims)}",
                    shard.span,
                    help="give one entry per dimension, `_` for replicated: "
                    f"{wname}[{', '.join('_' for _ in specs[wname].shape)}]",
                )
                ok = False
            else:
                given[wname] = shard
        tied = self._ties(rule, attrs, ties, given)
        ok = ok and tied is not None
        out = []
        reported = len(self.diags.items)
        for spec in specs.values():
            written = given.get(spec.name)
            if any(n <= 0 for n in spec.shape):
                ok = False
                continue
            if tied and spec.name in tied:
                tie = tied[spec.name]
                w = tied_weight(tie, spec.shape, path, self.declared, self.depth > 0, self.diags)
                ctx.weight_spans[spec.name] = tie.span
                if w is None:
                    ok = False
                else:
                    out.append(w)
                continue
            axis_sets = written.dims if written else tuple(ast.AxisSet((), span) for _ in spec.shape)
            what = f"weight `{path}.{spec.name}`"
            sizes = [None if padded.get(spec.name) == d else n for d, n in enumerate(spec.shape)]
            sharding = resolve(axis_sets, sizes, what, self.h.mesh, self.h.pipeline_axis, self.diags)
            ctx.weight_spans[spec.name] = written.span if written else span
            t = ir.TensorType(self.h.train.param_dtype, spec.shape, sharding)
            out.append(ir.Weight(spec.name, t, spec.initializer(), written.span if written else span))
        if len(self.diags.items) > reported:
            ctx.shardings_as_written = False
        return pad(out, vocab, path, self.h.mesh, self.diags) if ok else None

    def _ties(
        self,
        rule: LayerRule,
        attrs: dict[str, object],
        ties: tuple[ast.WeightTie, ...],
        given: Mapping[str, ast.WeightShard],
    ) -> dict[str, ast.WeightTie] | None:
        """The `tie` clauses by weight name; None after reporting a clause that names a weight
        the layer lacks, ties one twice, or ties one also sharded (E032)."""
        specs = {w.name for w in rule.weights(attrs)}
        out: dict[str, ast.WeightTie] = {}
        ok = True
        for tie in ties:
            wname = tie.weight.text
            if wname not in specs and wname in rule.possible_weights(attrs):
                continue  # as for `shard`: a weight another setting would give this use
            if wname not in specs:
                self._no_such_weight(rule, attrs, tie.weight, "E032", f"`{rule.kind}` has no weight `{wname}` to tie")
                ok = False
            elif wname in out:
                self._twice("E032", f"weight `{wname}` is tied twice", tie.span, out[wname].span, "tied")
                ok = False
            elif wname in given:
                self.diags.error(
                    "E032",
                    f"weight `{wname}` is tied and sharded: a tied weight is split as the weight it reads",
                    given[wname].span,
                    labels=[Label(tie.span, "tied here")],
                    help=f"drop `{wname}` from the `shard` clause, and shard the weight it is tied to",
                )
                ok = False
            else:
                out[wname] = tie
        return out if ok else None

    def _twice(self, code: str, message: str, span: Span, first: Span, done: str) -> None:
        self.diags.error(code, message, span, labels=[Label(first, f"first {done} here")])

    def _no_such_weight(
        self, rule: LayerRule, attrs: dict[str, object], name: ast.Ident, code: str, message: str
    ) -> None:
        known = ", ".join(f"`{w.name}`" for w in rule.weights(attrs)) or "none"
        guess = closest(name.text, sorted(rule.possible_weights(attrs)))
        self.diags.error(
            code,
            message,
            name.span,
            notes=[f"its weights: {known}"],
            help=f"did you mean `{guess}`?" if guess else None,
        )

    def _check_shard_axes(self, shards: tuple[ast.WeightShard, ...], path: str) -> None:
        """The axis names of a layer that could not be built: they need no shapes to check."""
        for shard in shards:
            what = f"weight `{path}.{shard.weight.text}`"
            resolve(shard.dims, [None] * len(shard.dims), what, self.h.mesh, self.h.pipeline_axis, self.diags)

    def _block(self, block: ast.BlockDef, call: ast.Call, path: str, flow: _Flow, scope: Scope) -> ir.Node | None:
        name = block.name.text
        if name in self.block_stack:
            chain = " -> ".join([*self.block_stack[self.block_stack.index(name) :], name])
            self.diags.error(
                "E028",
                f"block `{name}` uses itself ({chain})",
                call.span,
                labels=[Label(block.name.span, "defined here")],
            )
            flow.type = UNKNOWN
            return None
        specs = tuple(
            ArgSpec(p.name.text, "any", p.default if p.default is not None else REQUIRED) for p in block.params
        )  # type: ignore[arg-type]
        bound = self._bind(specs, call, scope, f"block `{name}`", globals_=self.h.constants)
        if bound is None:
            flow.type = UNKNOWN
            return None
        # A block's arguments are scalars (`_arg_value` of type "any" evaluates to one).
        inner: Scope = {**self.h.constants, **cast(Scope, bound)}
        x = flow.type
        self.block_stack.append(name)
        self.depth += 1
        first = len(self.diags.items)
        body = self._seq(block.body, flow, inner, path + ".", self._names(block.body))
        self._point_at_use(first, call, name)
        self.depth -= 1
        self.block_stack.pop()
        remat = self._remat(block, body, path)
        return ir.Block(path, name, remat, tuple(body), x, flow.type, call.span)

    def _point_at_use(self, first: int, call: ast.Call, name: str) -> None:
        """Label the mistakes found in a block's body with the use that led to them: the
        body's text is shared by every use, and the arguments of this one may be the cause."""
        use = Label(call.span, f"in this use of `{name}`")
        items = self.diags.items
        items[first:] = [d if d.span == call.span else replace(d, labels=(*d.labels, use)) for d in items[first:]]

    def _remat(self, block: ast.BlockDef, body: list[ir.Node], path: str) -> ir.Remat:
        cp = block.checkpoint
        if cp is None:
            return ir.Remat()
        policy = cp.policy.text
        if policy not in CHECKPOINT_POLICIES:
            self.diags.add(unknown_name("checkpoint policy", policy, cp.policy.span, CHECKPOINT_POLICIES, code="E026"))
            return ir.Remat()
        if policy != "selective":
            if cp.saved:
                self.diags.error(
                    "E026",
                    f"`checkpoint {policy}` takes no list of saved layers",
                    cp.span,
                    help=f"use `checkpoint selective({', '.join(i.text for i in cp.saved)})`",
                )
            remat = ir.Remat(policy)  # type: ignore[arg-type]
            if policy == "core_attention":
                self._has_cores(block, body, cp)
            return remat
        inside = [n.path for n in ir.walk(tuple(body)) if isinstance(n, ir.Layer)]
        short = {p.rsplit(".", 1)[-1] for p in inside}
        saved: list[str] = []
        for ident in cp.saved:
            # A name is a layer's path below the block (`mlp.up`) or the last part of it (`up`).
            matches = [p for p in inside if p[len(path) + 1 :] == ident.text or p.rsplit(".", 1)[-1] == ident.text]
            if not matches:
                message = f"block `{block.name.text}` has no layer `{ident.text}` to save"
                self.diags.add(unknown_name("layer", ident.text, ident.span, short, message=message))
            saved.extend(p for p in matches if p not in saved)
        if not cp.saved:
            self.diags.error(
                "E026",
                "`checkpoint selective(...)` needs the layers whose outputs are saved",
                cp.span,
                help="for example `checkpoint selective(attn)`",
            )
        return ir.Remat("selective", tuple(saved))

    def _has_cores(self, block: ast.BlockDef, body: list[ir.Node], cp: ast.Checkpoint) -> None:
        """`checkpoint core_attention` recomputes the cores of the block's own attention
        layers: a block without one is told so."""
        own = ir.own_layers(tuple(body))
        if any(RULES[layer.kind].core_flops(layer) for layer in own):
            return
        rings = [layer.path for layer in own if layer.kind == "attention"]
        self.diags.error(
            "E026",
            f"block `{block.name.text}` has no attention layer of its own whose core `checkpoint core_attention` "
            "could recompute",
            cp.span,
            notes=[f"`{rings[0]}` is ring attention, which keeps no scores"] if rings else [],
            help="use `checkpoint full` or `checkpoint selective(...)`, or put the policy on the block that "
            "holds the attention layer",
        )

    # arguments ---------------------------------------------------------------------------------

    def _bind(
        self,
        specs: Sequence[ArgSpec],
        call: ast.Call,
        scope: Scope,
        what: str,
        globals_: Mapping[str, ScalarValue] | None = None,
        spans: dict[str, Span] | None = None,
    ) -> dict[str, object] | None:
        """The call's arguments bound to `specs` and evaluated, defaults filled in; None after
        reporting what is wrong. `spans`, when given, receives where each argument written in
        the call is (those left to their defaults have none)."""
        by_name = {s.name: s for s in specs}
        raw: dict[str, ast.Arg] = {}
        ok = True
        positional = [a for a in call.args if a.name is None]
        seen_keyword = False
        for arg in call.args:
            if arg.name is not None:
                seen_keyword = True
            elif seen_keyword:
                self.diags.error("E024", "a positional argument cannot follow keyword arguments", arg.span)
                ok = False
        if not ok:
            # Binding positions out of order would only add "given twice" for the same slip.
            return None
        if len(positional) > len(specs):
            self.diags.error(
                "E024",
                f"{what} takes {len(specs)} positional argument{'s' if len(specs) != 1 else ''}, "
                f"but {len(positional)} were given",
                positional[len(specs)].span,
                notes=[f"{what} arguments: {', '.join(s.name for s in specs) or 'none'}"],
            )
            ok = False
        for spec, arg in zip(specs, positional, strict=False):
            raw[spec.name] = arg
        for arg in call.args:
            if arg.name is None:
                continue
            key = arg.name.text
            if key not in by_name:
                guess = closest(key, by_name)
                self.diags.error(
                    "E024",
                    f"{what} has no argument `{key}`",
                    arg.name.span,
                    notes=[f"{what} arguments: {', '.join(s.name for s in specs) or 'none'}"],
                    help=f"did you mean `{guess}`?" if guess else None,
                )
                ok = False
            elif key in raw:
                self.diags.error(
                    "E024",
                    f"argument `{key}` is given twice",
                    arg.span,
                    labels=[Label(raw[key].span, "first given here")],
                )
                ok = False
            else:
                raw[key] = arg
        if not ok:
            return None
        if spans is not None:
            spans.update((name, arg.span) for name, arg in raw.items())
        missing = [s for s in specs if s.name not in raw and s.default is REQUIRED]
        if missing:
            # One report for all of them: they share the call's span, and one report per code
            # and span is kept.
            names = [f"`{s.name}`" + (f" ({s.doc})" if s.doc else "") for s in missing]
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            self.diags.error(
                "E024",
                f"{what} needs argument{'s' if len(missing) > 1 else ''} {listed}",
                call.span,
                help=f"add {', '.join(f'`{s.name}=...`' for s in missing)}",
            )
            ok = False
        values: dict[str, object] = {}
        for spec in specs:
            if spec.name in raw:
                value = self._arg_value(spec, raw[spec.name], scope, what)
                if value is None:
                    ok = False
                    continue
                values[spec.name] = value
            elif spec.default is REQUIRED:
                continue
            elif callable(spec.default):
                if ok:
                    values[spec.name] = spec.default(values)
            elif isinstance(spec.default, ast.IntLit | ast.FloatLit | ast.BoolLit | ast.NameRef | ast.Neg | ast.Chain):
                # The arguments bound so far are scalars: a default refers to them by name.
                value = eval_value(spec.default, {**(globals_ or {}), **cast(Scope, values)}, self.diags)
                if value is None:
                    ok = False
                else:
                    values[spec.name] = value
            else:
                values[spec.name] = spec.default
        return values if ok else None

    def _arg_value(self, spec: ArgSpec, arg: ast.Arg, scope: Scope, what: str) -> object | None:
        v = arg.value
        if spec.type == "input":
            if not isinstance(v, ast.NameRef):
                self.diags.error("E024", f"`{spec.name}` of {what} names a declared input", v.span)
                return None
            if v.name not in self.h.inputs:
                self.diags.add(unknown_name("input", v.name, v.span, self.h.inputs))
                return None
            return v.name
        value = eval_value(v, scope, self.diags)
        if value is None:
            return None
        match spec.type:
            case "any":
                return value
            case "bool":
                if not isinstance(value, bool):
                    self.diags.error("E024", f"`{spec.name}` of {what} is true or false, got {_written(value)}", v.span)
                    return None
                return value
            case "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    self.diags.error("E024", f"`{spec.name}` of {what} is an integer, got {_written(value)}", v.span)
                    return None
                if spec.positive and value < 1:
                    self.diags.error("E024", f"`{spec.name}` of {what} must be positive, got {value}", v.span)
                    return None
                return value
            case "float":
                if isinstance(value, bool):
                    self.diags.error("E024", f"`{spec.name}` of {what} is a number, got {_written(value)}", v.span)
                    return None
                return float(value)
        raise AssertionError(spec.type)


def _fuse_reduce_scatter(layer: ir.Layer, layout: ir.Layout) -> ir.Layer:
    """A row-parallel sum re-split over the same axes right after is one reduce-scatter.

    Megatron's sequence parallelism: the partial sums of a row-parallel layer need only
    reach the device that keeps each slice of tokens, which moves half the bytes of an
    all-reduce (XLA on CPU still spells it all-reduce + slice).
    """
    if not layer.collectives or layer.collectives[-1].kind != "all-reduce":
        return layer
    summed = layer.collectives[-1]
    added = [
        tuple(a for a in new if a not in old)
        for old, new in zip(layout.input.sharding, layout.output.sharding, strict=True)
    ]
    if [axes for axes in added if axes] != [summed.axes] or layout.collectives:
        return layer
    scatter = ir.Collective(
        "reduce-scatter", summed.axes, summed.elements, summed.dtype, summed.why.replace("sum", "sum and re-split")
    )
    return replace(layer, collectives=(*layer.collectives[:-1], scatter))


def _written(value: object) -> str:
    """A value as a spec writes it (`true`, not Python's `True`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# ---- pipeline chunks ----------------------------------------------------------------------------


def _assign_chunks(
    segments: list[_Segment],
    pipeline: ir.Pipeline | None,
    header: _Header,
    diags: Diagnostics,
    misplaced_stages: bool = False,
) -> tuple[ir.Chunk, ...]:
    marked = [s for s in segments if s.kind != "loose"]
    if pipeline is None:
        for s in marked:
            diags.error(
                "E028",
                f"`{s.kind}` marks pipeline chunks, but the spec declares no pipeline",
                s.span,
                help="add `pipeline AXIS { schedule 1f1b  microbatches N }`",
            )
        return (ir.Chunk(0, 0, 0, tuple(n for s in segments for n in s.nodes)),)
    stages = header.mesh.size((pipeline.axis,))
    wanted = stages * pipeline.virtual
    kinds = {s.kind for s in marked}
    groups: list[list[ir.Node]]
    if kinds == {"stage", "stages"}:
        diags.error("E028", "use either `stage { }` blocks or one `stages { }` region, not both", marked[0].span)
        return ()
    if kinds == {"stages"}:
        if len(marked) > 1:
            diags.error(
                "E028",
                "a forward body has at most one `stages { }` region",
                marked[1].span,
                labels=[Label(marked[0].span, "first region")],
            )
            return ()
        region = marked[0]
        # A repeat is as many units as it has copies; the others are one each.
        units = sum(n.count if isinstance(n, ir.Repeat) else 1 for n in region.nodes)
        if not units or units % wanted:
            counts = divisor_sizes(units) if units else []
            diags.error(
                "E019",
                f"{units} layers cannot be split evenly into {wanted} pipeline chunks "
                f"({stages} stages x {pipeline.virtual} virtual)",
                region.span,
                labels=[Label(pipeline.span, "pipeline declared here")],
                notes=[f"{units} layers split evenly into {', '.join(map(str, counts))} chunks"] if counts else [],
                help="change the repeat count, the pipeline axis size in --mesh, or `virtual`",
            )
            return ()
        groups = _split_evenly(region.nodes, units // wanted)
        before = [n for s in segments[: segments.index(region)] for n in s.nodes]
        after = [n for s in segments[segments.index(region) + 1 :] for n in s.nodes]
    elif kinds == {"stage"}:
        if len(marked) != wanted:
            diags.error(
                "E018",
                f"the spec writes {len(marked)} stages, but the pipeline axis `{pipeline.axis}` has size "
                f"{stages} and `virtual` is {pipeline.virtual}, which makes {wanted} chunks",
                marked[0].span,
                labels=[Label(pipeline.span, "pipeline declared here")],
                help=f"write {wanted} `stage` blocks, or pass a --mesh whose `{pipeline.axis}` size "
                f"times `virtual` is {len(marked)}",
            )
            return ()
        groups = [list(s.nodes) for s in marked]
        first = segments.index(marked[0])
        before = [n for s in segments[:first] for n in s.nodes]
        after = []
        # Loose layers after a stage belong to the stage before them.
        g = -1
        for s in segments[first:]:
            if s.kind == "stage":
                g += 1
            else:
                groups[g].extend(s.nodes)
    else:
        # A `stage` written inside a block or residual was already reported; saying the body
        # marks no stages would only repeat that mistake.
        if wanted > 1:
            if not misplaced_stages:
                diags.error(
                    "E018",
                    f"the pipeline axis `{pipeline.axis}` has size {stages} (x {pipeline.virtual} virtual), "
                    "but the forward body marks no stages",
                    pipeline.span,
                    help="wrap the repeated layers in `stages { }`, or write `stage { }` blocks",
                )
            return ()
        groups = [[n for s in segments for n in s.nodes]]
        before, after = [], []
    groups[0][:0] = before
    groups[-1].extend(after)
    stage = _placement(pipeline, stages, len(groups))
    return tuple(
        ir.Chunk(i, stage[i], stage[:i].count(stage[i]), tuple(g), g[0].span if g else NO_SPAN)
        for i, g in enumerate(groups)
    )


def _placement(pipeline: ir.Pipeline, stages: int, chunks: int) -> tuple[int, ...]:
    """The stage that holds each chunk, as the schedule places it (chunk c on stage c mod P
    but in a V); where the schedule cannot say (its own mistake, reported by the checker),
    the ring's."""
    if pipeline.table is not None and len(pipeline.table.placement) == chunks:
        return pipeline.table.placement
    try:
        found = placement(pipeline.schedule, stages, pipeline.virtual)
    except ScheduleError:
        found = ()
    return found if len(found) == chunks else tuple(i % stages for i in range(chunks))


def _split_evenly(nodes: list[ir.Node], per: int) -> list[list[ir.Node]]:
    """Cut a run of nodes into groups of `per` units each, a repeat counting one unit per copy:
    a repeat that straddles a cut is shared, each group running its own copies of it."""
    groups: list[list[ir.Node]] = [[]]
    room = per
    for node in nodes:
        if not isinstance(node, ir.Repeat):
            if not room:
                groups.append([])
                room = per
            groups[-1].append(node)
            room -= 1
            continue
        done = 0
        while done < node.count:
            if not room:
                groups.append([])
                room = per
            take = min(room, node.count - done)
            groups[-1].append(replace(node, count=take, first=node.first + done, total=node.length))
            done += take
            room -= take
    return groups
