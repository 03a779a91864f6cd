"""Checked IR -> the text of a standalone Python module, through the templates in `templates/`.

Output is a function of the program and the spec's text alone: no paths, times or versions,
so it is byte-identical run to run and can be kept as a golden file.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import PurePath

import jinja2

from dslc.codegen import source
from dslc.codegen.names import class_name, global_namer, safe_identifier
from dslc.codegen.view import JAX_DTYPE_NAMES, Builder, ModuleClass, Statement
from dslc.ir import nodes as ir
from dslc.ir.boundaries import boundary_of, chunk_input
from dslc.ir.inputs import integer_bounds
from dslc.ir.state import state_sharding
from dslc.kernels import SOURCES
from dslc.layers import LOSS_KINDS, RULES
from dslc.schedules import build
from dslc.schedules.buffers import ExecutionPlan, plan
from dslc.schedules.render import to_text

# The first line after the docstring of every generated module: `dslc compile` overwrites
# only files that carry it.
MARKER = "# dslc-generated: written by `dslc compile`; edits will be lost when it is regenerated."

# Names the module defines or imports at top level; generated class names must avoid them.
_MODULE_NAMES = {
    "P",
    "NamedSharding",
    "NamedTuple",
    "Parameter",
    "Input",
    "Aux",
    "PARAMETERS",
    "INPUTS",
    "STREAM",
    "MESH_AXES",
    "MESH_SHAPE",
    "DEVICES",
    "COMPUTE_DTYPE",
    "SCHEDULE",
    "STAGES",
    "CHUNK_INPUTS",
    "BOUNDARY",
    "ACCUMULATE",
    "OPTIMIZER",
    "argparse",
}

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("dslc.codegen", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


def py(value: object) -> str:
    """A Python literal for a plain value, written as `ruff format` writes it."""
    match value:
        case bool() | None:
            return repr(value)
        case int():
            return repr(value)
        case float():
            return repr(value) if math.isfinite(value) else f'float("{value}")'
        case str():
            text = repr(value)
            if text.startswith("'") and '"' not in value:
                text = '"' + text[1:-1].replace("\\'", "'") + '"'
            return text
        case tuple():
            inner = ", ".join(py(v) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        case list():
            return "[" + ", ".join(py(v) for v in value) + "]"
        case dict():
            return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no literal for {value!r}")


def spec(sharding: ir.Sharding) -> str:
    """`P("data", None, ("data", "fsdp"))` for a per-dimension tuple of mesh axes."""
    dims = [py(None) if not axes else py(axes[0]) if len(axes) == 1 else py(axes) for axes in sharding]
    return "P(" + ", ".join(dims) + ")"


_ENV.filters["py"] = py
_ENV.filters["spec"] = spec


def generate(program: ir.Program, spec_text: str, spec_name: str, mesh_size: str) -> str:
    """The module for `program`, checked from `spec_text` (named `spec_name`), at `mesh_size`."""
    file = _display_name(spec_name)
    taken = _MODULE_NAMES | set(source.PRELUDE_IMPORTS) | _kernel_names()
    builder = Builder(program, spec_text.split("\n"), file, global_namer(taken))
    nodes = tuple(n for chunk in program.chunks for n in chunk.nodes)
    loss: Statement | None = None
    loss_layer = nodes[-1] if nodes and isinstance(nodes[-1], ir.Layer) and nodes[-1].kind in LOSS_KINDS else None
    pipelined = (
        program.pipeline is not None and program.mesh.size((program.pipeline.axis,)) * program.pipeline.virtual > 1
    )
    top: list[ModuleClass] = []
    if pipelined:
        word = "Chunk" if program.pipeline is not None and program.pipeline.virtual > 1 else "Stage"
        for chunk in program.chunks:
            body = chunk.nodes[:-1] if loss_layer is not None and chunk is program.chunks[-1] else chunk.nodes
            name = builder.global_names.claim(f"{word}{chunk.index}")
            doc = f"Chunk {chunk.index} of the pipeline, run by stage {chunk.stage}."
            top.append(builder.module_class(name, doc, _lines(file, body), body, None))
    else:
        body = nodes[:-1] if loss_layer is not None else nodes
        name = builder.global_names.claim(_model_class(program.name))
        top.append(
            builder.module_class(name, f"The `{safe_identifier(program.name)}` model.", _lines(file, body), body, None)
        )
    if loss_layer is not None:
        scratch = ModuleClass("", "", "")
        loss = builder.layer(scratch, loss_layer, "x", None, global_namer(set()))
    # Accumulated slices of a loss that averages over the positions it counts weigh by their count.
    count = RULES[loss_layer.kind].count_kernel if loss_layer is not None and program.train.accumulate > 1 else None
    kernels = _kernels(program, pipelined, count)
    imports = _imports(kernels)
    mesh_axes = program.mesh.names or ("replica",)
    mesh_shape = program.mesh.shape or (1,)
    context = {
        "model": safe_identifier(program.name),
        "file": file,
        "module_file": safe_identifier(program.name) + ".py",
        "mesh_text": _mesh_text(mesh_axes, mesh_shape),
        "mesh_size": mesh_size,
        "marker": MARKER,
        "imports": imports,
        "mesh_axes": mesh_axes,
        "mesh_shape": mesh_shape,
        "devices": math.prod(mesh_shape),
        "compute_dtype": JAX_DTYPE_NAMES[program.train.compute_dtype],
        "pipelined": pipelined,
        # Whether any layer returns auxiliary values (a mixture of experts' balancing loss):
        # only then does the code thread them through.
        "aux": any(RULES[layer.kind].has_aux for layer in ir.all_layers(program)),
        "parameters": _parameters(program),
        "inputs": _inputs(program, builder),
        "stream": program.stream,
        "kernels": kernels,
        "classes": [*builder.blocks, *top],
        "top": [c.name for c in top],
        "loss": loss,
        "schedule": _schedule(program) if pipelined else None,
        "accumulate": program.train.accumulate,
        "count": count,
        "optimizer": {"name": program.train.optimizer.name, "hyper": dict(program.train.optimizer.hyper)},
    }
    return _ENV.get_template("module.py.j2").render(context)


# ---- parts of the context -----------------------------------------------------------------------


def _display_name(spec_name: str) -> str:
    """The spec's file name as comments show it: its base name, in safe characters."""
    base = PurePath(spec_name.replace("\\", "/")).name or "spec.par"
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in base)


def _model_class(name: str) -> str:
    return class_name(name)


def _mesh_text(axes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    sizes = ", ".join(f"{a}={s}" for a, s in zip(axes, shape, strict=True))
    return "x".join(str(s) for s in shape) + f" ({sizes})"


def _lines(file: str, nodes: tuple[ir.Node, ...]) -> str:
    lines = [n.span.line for n in nodes if n.span.line > 0]
    return f"{file}:{min(lines)}-{max(lines)}" if lines else file


def _parameters(program: ir.Program) -> list[dict[str, object]]:
    chunk_of = {
        f"{layer.path}.{w.name}": chunk.index
        for chunk in program.chunks
        for layer in ir.layers(chunk.nodes)
        for w in layer.weights
    }
    out = []
    for name, w in ir.weights_by_path(program).items():
        state = state_sharding(w.type, program)
        out.append(
            {
                "name": name,
                "shape": w.type.shape,
                "dtype": JAX_DTYPE_NAMES[w.type.dtype],
                "init": w.init,
                "sharding": state.params,
                "grad": state.grads,
                "optimizer": state.optimizer,
                "chunk": chunk_of[name],
            }
        )
    return out


def _inputs(program: ir.Program, builder: Builder) -> list[dict[str, object]]:
    bounds = integer_bounds(program)
    return [
        {
            "name": i.name,
            "shape": i.type.shape,
            "dtype": JAX_DTYPE_NAMES[i.type.dtype],
            "sharding": i.type.sharding,
            "bound": bounds.get(i.name, 2),
            "source": builder.where(i.span),
        }
        for i in program.inputs
    ]


def _schedule(program: ir.Program) -> dict[str, object]:
    p = program.pipeline
    assert p is not None
    stages = program.mesh.size((p.axis,))
    entries = [f.name for f in fields(ExecutionPlan) if f.type == "Table"]
    shape, dtype = boundary_of(program, p.microbatches)
    schedule = build(p.schedule, stages, p.microbatches, p.virtual)
    table = plan(schedule)
    timeline = to_text(schedule).rstrip("\n").split("\n")
    command = f"dslc schedule --kind {p.schedule} --stages {stages} --microbatches {p.microbatches}"
    return {
        # The timeline as `dslc schedule` draws it, where it fits in a comment.
        "timeline": timeline
        if max(map(len, timeline)) <= 110
        else [timeline[0], f"(too wide for here: `{command} --virtual {p.virtual}` draws it)"],
        "kind": p.schedule,
        "stages": stages,
        "microbatches": p.microbatches,
        "virtual": p.virtual,
        "axis": p.axis,
        "table": [(name, [list(row) for row in getattr(table, name)]) for name in entries],
        "chunk_inputs": [chunk_input(chunk, p.microbatches) for chunk in program.chunks],
        "boundary_shape": shape,
        "boundary_dtype": JAX_DTYPE_NAMES[dtype or program.train.compute_dtype],
    }


def _kernels(program: ir.Program, pipelined: bool, count: str | None) -> list[source.Definition]:
    wanted = {"params": ["named_key", "initial_value"], "training": ["make_optimizer", "accumulate_gradients"]}
    layers = ir.all_layers(program)
    wanted["layers"] = sorted({RULES[layer.kind].kernel(dict(layer.attrs), layer.operand) for layer in layers})
    if count is not None:
        wanted["layers"].append(count)
    if any(RULES[layer.kind].has_aux for layer in layers):
        wanted["layers"] += ["AUX_LOSS", "add_aux"]
    if pipelined:
        wanted["pipeline"] = ["pipeline_value_and_grad"]
    out: list[source.Definition] = []
    for name, module in SOURCES.items():
        if name in wanted:
            out.extend(source.closure(module, wanted[name]))
    return out


def _kernel_names() -> set[str]:
    return {name for module in SOURCES.values() for name in source.definitions(module)}


def _imports(kernels: list[source.Definition]) -> list[str]:
    """The import lines the module needs: the kernels' and the templates' own."""
    needed = source.names_used(kernels) & set(source.PRELUDE_IMPORTS)
    needed |= {"functools", "np", "jax", "jnp", "optax", "nnx", "lax", "checkpoint_name", "Any", "Callable"}
    lines = {source.PRELUDE_IMPORTS[n] for n in needed}
    lines |= {
        "import argparse",
        "from jax.sharding import NamedSharding",
        "from jax.sharding import PartitionSpec as P",
    }
    lines |= {"from typing import NamedTuple"}
    return _sorted_imports(lines)


def _sorted_imports(lines: set[str]) -> list[str]:
    """Imports as ruff's isort writes them: the standard library, then third parties, one
    blank line between; in each, `import x` lines before `from x import y` lines, by module;
    names of one `from` merged (constants, then classes, then the rest), `as` imports apart."""
    stdlib = {"argparse", "functools", "math", "zlib", "typing", "collections"}
    merged: dict[str, set[str]] = {}
    kept: set[str] = set()
    for line in lines:
        if line.startswith("from ") and " as " not in line:
            module, _, listed = line[5:].partition(" import ")
            merged.setdefault(module, set()).update(n.strip() for n in listed.split(","))
        else:
            kept.add(line)
    for module, names in merged.items():
        kept.add(f"from {module} import {', '.join(sorted(names, key=_name_order))}")
    sections: dict[bool, list[str]] = {True: [], False: []}
    for line in kept:
        sections[line.split()[1].split(".")[0] in stdlib].append(line)
    out: list[str] = []
    for in_stdlib in (True, False):
        entries = sorted(sections[in_stdlib], key=lambda line: (line.startswith("from "), line.split()[1], line))
        if out and entries:
            out.append("")
        out.extend(entries)
    return out


def _name_order(name: str) -> tuple[int, str]:
    if name.isupper():
        return 0, name
    return (1 if name[:1].isupper() else 2), name
