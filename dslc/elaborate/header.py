"""Read the header: the model's name, its mesh, constants, inputs, training settings and
block definitions — everything the forward body is elaborated against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dslc.diagnostics import Diagnostic, Diagnostics, Label, Span
from dslc.elaborate.spelling import spelled
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue, eval_expr, eval_value
from dslc.ir.names import unknown_name
from dslc.ir.settings import read_train
from dslc.ir.shardings import resolve
from dslc.layers import RULES
from dslc.syntax import ast

DTYPES = tuple(ir.DTYPE_BYTES)


@dataclass
class Header:
    """What the header declares, as the body is elaborated against it."""

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


def read_header(
    module: ast.Module,
    mesh_sizes: Sequence[int] | None,
    diags: Diagnostics,
    overrides: Mapping[str, ScalarValue],
) -> Header:
    """The header as declared; each problem reported, a stand-in taking its place."""
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
    forward = singles.get(ast.ForwardDef)
    constants = read_constants(module, overrides, diags)
    header = Header(
        name=name,
        mesh=mesh,
        constants=constants,
        inputs={},
        blocks={},
        forward=forward if isinstance(forward, ast.ForwardDef) else None,
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
        axes.append(ir.MeshAxis(axis.name.text, size or 1, axis.span, _nodes(axis, size or 1, diags)))
    return ir.Mesh(tuple(axes))


def _nodes(axis: ast.MeshAxis, size: int, diags: Diagnostics) -> int:
    """How many nodes the axis spans: its `across N nodes`, which must split its size evenly."""
    if axis.nodes is None:
        return 1
    nodes = eval_expr(axis.nodes, {}, diags)
    if nodes is None:
        return 1
    name = axis.name.text
    if nodes < 1:
        diags.error("E023", f"mesh axis `{name}` must span at least 1 node, got {nodes}", axis.nodes.span)
        return 1
    if size % nodes:
        fits = [n for n in range(1, size + 1) if size % n == 0]
        diags.error(
            "E023",
            f"mesh axis `{name}` of size {size} cannot span {nodes} nodes: each node must hold the same share of it",
            axis.nodes.span,
            help=f"a node count that divides {size} ({', '.join(map(str, fits))}), or a size that {nodes} divides",
        )
        return 1
    return nodes


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


def _read_inputs(module: ast.Module, header: Header, diags: Diagnostics) -> dict[str, ir.Input]:
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
        names = {c: c for c in header.constants}
        written = tuple(spelled(dim.size, names) or "" for dim in t.dims)
        inputs[name] = ir.Input(name, ir.TensorType(dtype, shape, sharding), decl.span, written)
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
