"""Checked IR -> the text of a standalone Python module, through the templates in `templates/`.

Output is a function of the program and the spec's text alone: no paths, times or versions,
so it is byte-identical run to run and can be kept as a golden file.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import PurePath

import jinja2

from dslc.codegen import source
from dslc.codegen.layout import laid_out
from dslc.codegen.names import class_name, global_namer, safe_identifier
from dslc.codegen.shapes import spelled_init, spelled_shape
from dslc.codegen.view import Builder, Code, ModuleClass, Statement
from dslc.ir import nodes as ir
from dslc.ir.boundaries import boundary_of, chunk_input
from dslc.ir.data_parallel import data_parallel_axes
from dslc.ir.placement import Placement, Share, StateSharding, StoredArray, place
from dslc.ir.schedule import schedule_of
from dslc.ir.signature import chunk_signature
from dslc.layers import RULES, args
from dslc.layers.base import BoundKernel
from dslc.layers.inputs import integer_bounds
from dslc.layers.moe import MoE
from dslc.schedules.notation import timelines
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
    "Arrays",
    "Mesh",
    "PARAMETERS",
    "INPUTS",
    "STREAM",
    "MESH_AXES",
    "MESH_SHAPE",
    "DEVICES",
    "COMPUTE_DTYPE",
    "SCHEDULE",
    "TIMELINES",
    "STAGES",
    "CHUNK_WEIGHTS",
    "CHUNK_INPUTS",
    "BOUNDARY",
    "PIPELINE",
    "ACCUMULATE",
    "DATA_AXES",
    "OPTIMIZER",
    "MASTER_DTYPE",
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
        case Code():
            return str(value)
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
        case BoundKernel(kernel=kernel, keywords=keywords):
            return f"functools.partial({kernel}" + "".join(f", {k}={py(v)}" for k, v in keywords) + ")"
    raise TypeError(f"no literal for {value!r}")


def spec(sharding: ir.Sharding) -> str:
    """`P("data", None, ("data", "fsdp"))` for a per-dimension tuple of mesh axes."""
    return "P(" + ", ".join(spec_entries(sharding)) + ")"


def spec_entries(sharding: ir.Sharding) -> list[str]:
    """A PartitionSpec's entries: None, one axis, or a tuple of axes per dimension."""
    return [py(None) if not axes else py(axes[0]) if len(axes) == 1 else py(axes) for axes in sharding]


def runs(entries: list[str]) -> list[str]:
    """The entries of a tuple or list, each run of three or more equal ones as `*[entry] * n`."""
    out: list[str] = []
    for entry, group in itertools.groupby(entries):
        n = len(list(group))
        out += [f"*[{entry}] * {n}"] if n >= 3 else [entry] * n
    return out


_ENV.filters["py"] = py
_ENV.filters["spec"] = spec
_ENV.filters["runs"] = runs


def generate(
    program: ir.Program,
    spec_text: str,
    spec_name: str,
    mesh_size: str,
    regenerate: tuple[str, str] | None = None,
) -> str:
    """The module for `program`, checked from `spec_text` (named `spec_name`), at `mesh_size`.
    `regenerate` is (the command that writes it again, its file name), as its docstring shows
    them (default: `dslc compile` of the spec's base name, and the model's name)."""
    file = _display_name(spec_name)
    taken = _MODULE_NAMES | set(source.PRELUDE_IMPORTS) | _kernel_names()
    builder = Builder(program, spec_text.split("\n"), file, global_namer(taken))
    placement = place(program)
    top: list[ModuleClass] = []
    stages: list[str] = []
    if program.pipelined:
        word = "Chunk" if program.pipeline is not None and program.pipeline.virtual > 1 else "Stage"
        classes: dict[object, str] = {}
        for chunk in program.chunks:
            body = program.chunk_body(chunk)
            key = chunk_signature(body)
            if key not in classes:
                classes[key] = builder.global_names.claim(f"{word}{chunk.index}")
                same = [c.index for c in program.chunks if chunk_signature(program.chunk_body(c)) == key]
                doc = (
                    f"Chunk {chunk.index} of the pipeline, run by stage {chunk.stage}."
                    if len(same) == 1
                    else f"Chunks {_ranges(same)} of the pipeline, each running its own share of the layers."
                )
                top.append(builder.module_class(classes[key], doc, _lines(file, body), body, None))
            stages.append(classes[key])
    else:
        name = builder.global_names.claim(class_name(program.name))
        doc = f"The `{safe_identifier(program.name)}` model."
        top.append(builder.module_class(name, doc, _lines(file, program.body), program.body, None))
    loss: Statement | None = None
    if program.loss is not None:
        loss = builder.layer(ModuleClass("", "", ""), program.loss, "x", None, global_namer(set()))
    # A loss that averages over the positions it counts (cross-entropy's ignored targets):
    # slices of the batch (accumulation steps, microbatches) weigh by their count.
    count = RULES[program.loss.kind].count_kernel if program.loss is not None else None
    data_axes = data_parallel_axes(program)
    chunk_weights = _chunk_weights(placement) if program.pipelined else []
    mesh_axes = program.mesh.names or ("replica",)
    parameters = _parameters(program, placement, builder, [*builder.blocks, *top])
    mesh_shape = program.mesh.shape or (1,)
    context = {
        "model": safe_identifier(program.name),
        "file": file,
        "module_file": regenerate[1] if regenerate else safe_identifier(PurePath(file).stem) + ".py",
        "mesh_text": _mesh_text(mesh_axes, mesh_shape),
        "regenerate": regenerate[0] if regenerate else f"dslc compile {file} --mesh {mesh_size} --force",
        "marker": MARKER,
        "mesh_axes": mesh_axes,
        "mesh_shape": mesh_shape,
        "devices": math.prod(mesh_shape),
        "mesh_nodes": tuple(a.nodes for a in program.mesh.axes) or (1,),
        "compute_dtype": ir.DTYPES[program.train.compute_dtype].jax,
        "pipelined": program.pipelined,
        # Whether any layer returns auxiliary values (a mixture of experts' balancing loss):
        # only then does the code thread them through.
        "aux": any(RULES[layer.kind].has_aux for layer in ir.all_layers(program)),
        "parameters": parameters,
        "legend": [
            (k, meaning) for k, meaning in KEYWORDS.items() if any(re.search(rf"\b{k}=", e) for e in parameters)
        ],
        "inputs": _inputs(program, builder),
        "stream": program.stream,
        "classes": [*builder.blocks, *top],
        "top": [c.name for c in top],
        "stages": stages,
        "chunk_weights": chunk_weights,
        "loss": loss,
        "schedule": _schedule(program) if program.pipelined else None,
        "accumulate": program.train.accumulate,
        "data_axes": data_axes,
        "count": count,
        "optimizer": {
            "name": program.train.optimizer.name,
            "hyper": dict(program.train.optimizer.hyper),
            "balanced": _balanced(program, placement),
        },
        "master": ir.DTYPES[program.train.master_dtype].jax if program.train.master_dtype else None,
        "grad_dtype": ir.DTYPES[program.train.grad_dtype].jax if program.train.grad_dtype else None,
        # Last: the constants the classes and the loss above named, in the spec's order.
        "constants": [(builder.constants[name], v) for name, v in program.constants if name in builder.constants],
    }
    # The imports are what the rendered code calls: the runtime's functions and classes it
    # names, and the libraries it and the templates use.
    template = _ENV.get_template("module.py.j2")
    return laid_out(template.render(context | {"imports": _imports(template.render(context | {"imports": []}))}))


# ---- parts of the context -----------------------------------------------------------------------


def _display_name(spec_name: str) -> str:
    """The spec's file name as comments show it: its base name, in safe characters."""
    base = PurePath(spec_name.replace("\\", "/")).name or "spec.par"
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in base)


def _mesh_text(axes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    sizes = ", ".join(f"{a}={s}" for a, s in zip(axes, shape, strict=True))
    return "x".join(str(s) for s in shape) + f" ({sizes})"


def _lines(file: str, nodes: tuple[ir.Node, ...]) -> str:
    lines = [n.span.line for n in nodes if n.span.line > 0]
    if not lines:
        return file
    return f"{file}:{min(lines)}" if min(lines) == max(lines) else f"{file}:{min(lines)}-{max(lines)}"


def _ranges(indices: list[int]) -> str:
    """`1-14` for consecutive indices, else a list."""
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))


def _balanced(program: ir.Program, placement: Placement) -> dict[str, float]:
    """Each stored array of mixture-of-experts balancing biases, with its rate (the `moe`'s
    `balance`; the largest, should the layers an array holds differ)."""
    rates: dict[str, float] = {}
    for layer in ir.all_layers(program):
        rate = args(layer, MoE).balance if layer.kind == "moe" else 0.0
        if not rate:
            continue
        assert isinstance(rate, float)
        path = f"{layer.path}.balance_bias"
        for array in placement.arrays:
            if path in _layer_paths(array.name):
                rates[array.name] = max(rate, rates.get(array.name, 0.0))
    return rates


def _layer_paths(name: str) -> list[str]:
    """The paths of the layers' weights a stored array holds, as the IR names them: `a|b.w`
    holds a.w and b.w, and `layers.*.moe.w` every copy of the repeated `layers.moe.w`."""
    head, _, last = name.replace("*.", "").rpartition(".")
    return [f"{p}.{last}" for p in head.split("|")]


# What each keyword of a `Parameter(...)` says, for the module's legend of those it uses.
KEYWORDS = {
    "grad_sharding": "where its gradient lives, if not like the array (ZeRO 2 and up: over the data axes)",
    "optimizer_sharding": "where its optimizer state lives, if not like the array (ZeRO 1 and up)",
    "layers": "how many leading dimensions each `*` of its name spans (a repeat's layers)",
    "rows": "one row per pipeline stage, each holding a weight of that stage's own",
    "stage_rows": "the dimension whose pieces are each pipeline stage's own (layers or rows)",
    "stage_split": "the dimension it is split along over the stages between steps; a step gathers it",
    "padding": "padding at the end of each of its own dimensions (a vocabulary split evenly)",
}

# The fewest of a repeat's arrays that `PARAMETERS` lists as a table rather than one by one.
TABLE_FROM = 4


def _parameters(program: ir.Program, placement: Placement, builder: Builder, classes: list[ModuleClass]) -> list[str]:
    """The entries of the `PARAMETERS` table (each as its first line follows 4 spaces): one
    `Parameter(...)` per stored array; a repeat's arrays, from `TABLE_FROM` of them, as one
    loop over a table of what differs between them (a block's weights read as one table),
    which the block's class holds where one class runs the repeat."""
    arrays = list(placement.arrays)
    out: list[str] = []
    while arrays:
        group = _repeat_group(program, arrays)
        loop = _repeat_entry(program, builder, classes, group) if len(group) >= TABLE_FROM else None
        out.extend([loop] if loop is not None else [_parameter_entry(program, builder, a) for a in group])
        del arrays[: len(group)]
    return out


def _parameter_entry(program: ir.Program, builder: Builder, array: StoredArray) -> str:
    state = array.state(program)
    args = [
        _tuple(spelled_shape(program, builder.code, array)),
        py(ir.DTYPES[array.type.dtype].jax),
        spelled_init(program, builder.code, array) or py(array.init),
        spec(state.params),
    ]
    args += _placement_keywords(array, state.grads, state.params, state.optimizer)
    if array.rows:
        rows = [
            "None"
            if row is None
            else f"Row({py(row.name)}, {py(row.shape)}, {py(row.init)}" + (f", {row.first})" if row.first else ")")
            for row in array.rows
        ]
        args.append("\n".join(["rows=(", *(f"{' ' * 12}{row}," for row in rows), " " * 8 + ")"]))
    return f"{py(array.name)}: Parameter({', '.join(args)}),"


def _placement_keywords(
    array: StoredArray, grads: ir.Sharding, params: ir.Sharding, optimizer: ir.Sharding
) -> list[str]:
    """The keywords of a `Parameter(...)` past its shape, dtype, init and sharding."""
    args = []
    if grads != params:
        args.append("grad_sharding=" + spec(grads))
    if optimizer != params:
        args.append("optimizer_sharding=" + spec(optimizer))
    if array.layers:
        args.append("layers=" + py(array.layers))
    if array.stage_dim is not None:
        args.append(f"stage_rows={array.stage_dim}")
    if array.split_dim is not None:
        args.append(f"stage_split={array.split_dim}")
    if array.padding:
        args.append("padding=" + py(array.padding))
    return args


def _repeat_group(program: ir.Program, arrays: list[StoredArray]) -> list[StoredArray]:
    """The arrays `arrays` starts with that one loop can print: a repeat's (`blocks.*.`), alike
    in all but their name, the shape and sharding past their layer dimensions, and init; or
    just the first array."""
    first = arrays[0]
    if not first.layers or first.rows or ".*." not in first.name:
        return arrays[:1]
    prefix = first.name[: first.name.index(".*.") + 3]
    n = sum(first.layers)
    states = [a.state(program) for a in arrays]

    def alike(a: StoredArray, state: StateSharding) -> bool:
        shared = (a.type.dtype, a.layers, a.stage_dim, a.split_dim, a.padding, a.rows, a.type.shape[:n])
        leads = (state.params[:n], state.grads[:n], state.optimizer[:n])
        differs = (state.grads != state.params, state.optimizer != state.params)
        s0 = states[0]
        return (
            a.name.startswith(prefix)
            and shared
            == (
                first.type.dtype,
                first.layers,
                first.stage_dim,
                first.split_dim,
                first.padding,
                (),
                first.type.shape[:n],
            )
            and leads == (s0.params[:n], s0.grads[:n], s0.optimizer[:n])
            and differs == (s0.grads != s0.params, s0.optimizer != s0.params)
        )

    count = next((i for i, (a, st) in enumerate(zip(arrays, states, strict=True)) if not alike(a, st)), len(arrays))
    return arrays[:count]


def _repeat_entry(
    program: ir.Program, builder: Builder, classes: list[ModuleClass], group: list[StoredArray]
) -> str | None:
    """A repeat's arrays as a dict comprehension over a table of what differs between them:
    the `WEIGHTS` of the block class the repeat runs, where it runs one (and no other repeat
    of it stores its weights otherwise), else a table of its own."""
    first = group[0]
    prefix = first.name[: first.name.index(".*.") + 3]
    if not re.fullmatch(r"[A-Za-z0-9_.*]+", prefix):
        return None
    n = sum(first.layers)
    state = first.state(program)
    columns = ["name", "shape", "init", "sharding"]
    grads, optimizer = state.grads != state.params, state.optimizer != state.params
    columns += ["grad"] * grads + ["optimizer"] * optimizer

    def lead(sharding: ir.Sharding, column: str) -> str:
        return "P(" + ", ".join([*spec_entries(sharding[:n]), "*" + column]) + ")"

    args = [_tuple([*spelled_shape(program, builder.code, first)[:n], "*shape"]), py(ir.DTYPES[first.type.dtype].jax)]
    args += ["init", lead(state.params, "sharding")]
    keywords = _placement_keywords(first, state.grads, state.params, state.optimizer)
    keywords = [k for k in keywords if not k.startswith(("grad_sharding=", "optimizer_sharding="))]
    args += ["grad_sharding=" + lead(state.grads, "grad")] * grads
    args += ["optimizer_sharding=" + lead(state.optimizer, "optimizer")] * optimizer
    args += keywords
    rows = []
    for a in group:
        st = a.state(program)
        row = [py(a.name[len(prefix) :]), _tuple(spelled_shape(program, builder.code, a)[n:])]
        row += [spelled_init(program, builder.code, a) or py(a.init)]
        row += [_entries_tuple(st.params[n:])]
        row += [_entries_tuple(st.grads[n:])] * grads + [_entries_tuple(st.optimizer[n:])] * optimizer
        rows.append(f"({', '.join(row)}),")
    name = "f" + py(prefix + "{name}")
    layers = " x ".join(map(str, first.type.shape[:n]))
    element = f"{name}: Parameter({', '.join(args)})"
    owner = _runs(classes, prefix)
    if owner is not None and owner.weights_table in ([], rows) and owner.weights_columns in ((), tuple(columns)):
        owner.weights_table, owner.weights_columns = rows, tuple(columns)
        return "\n".join(
            [
                f"# The weights of `{prefix[:-1]}`: each of {owner.name}'s stacked over its {layers} layers.",
                "    **{",
                f"        {element}",
                f"        for {', '.join(columns)} in {owner.name}.WEIGHTS",
                "    },",
            ]
        )
    return "\n".join(
        [
            f"# The weights of `{prefix[:-1]}`: each stacks its {layers} layers ahead of one layer's shape",
            "    # and sharding, which the table gives with its name in the block and its init.",
            "    **{",
            f"        {element}",
            f"        for {', '.join(columns)} in (",
            *(f"            {row}" for row in rows),
            "        )",
            "    },",
        ]
    )


def _runs(classes: list[ModuleClass], prefix: str) -> ModuleClass | None:
    """The block class every top-level use of the repeat storing its weights under `prefix`
    (`layers.*.`) runs, if one class does."""
    names = {
        a.cls for c in classes if not c.is_block for a in c.attributes if a.kind == "layers" and a.prefix == prefix
    }
    return next((c for c in classes if c.is_block and {c.name} == names), None)


def _tuple(entries: list[str]) -> str:
    return "(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"


def _entries_tuple(sharding: ir.Sharding) -> str:
    return _tuple(spec_entries(sharding))


def _chunk_weights(placement: Placement) -> list[str]:
    """The entries of the `CHUNK_WEIGHTS` tuple, each with its comma (as its first line
    follows 4 spaces): a chunk's dict of weights, or, for a chunk holding only a repeat's
    layers, the `layer_shares(...)` that makes it; a run of three or more such chunks, each
    holding the next equal share of the layers, as one loop over them."""
    chunks = _shares(placement)
    out: list[str] = []
    while chunks:
        entries, layers = chunks[0]
        if layers is None:
            out.append("{" + ", ".join(entries) + "},")
            del chunks[0]
            continue
        prefix, (start, stop) = layers
        step = stop - start
        run = 1
        while run < len(chunks) and chunks[run][1] == (prefix, (start + run * step, stop + run * step)):
            run += 1
        if run < 3:
            out.append(f"layer_shares(PARAMETERS, {py(prefix)}, {py((start, stop))}),")
            del chunks[0]
            continue
        shares = f"layer_shares(PARAMETERS, {py(prefix)}, (i, i + {step}))"
        out.append(f"*({shares} for i in range({start}, {start + run * step}, {step})),")
        del chunks[:run]
    return out


def _shares(placement: Placement) -> list[tuple[list[str], tuple[str, tuple[int, int]] | None]]:
    """Per chunk: the entries of its dict of weights, each name in the chunk and the
    `Share(...)` that says where it is, a repeat's layers of all its arrays in one entry; and
    (prefix, layers) where that one entry is all the chunk holds, else None."""
    out: list[tuple[list[str], tuple[str, tuple[int, int]] | None]] = []
    for chunk in placement.shares:
        entries = []
        only: tuple[str, tuple[int, int]] | None = None
        items = list(chunk.items())
        while items:
            name, share = items[0]
            layers = _layers_of_repeat(placement, items)
            if layers is not None:
                prefix, count = layers
                entries.append(f"**layer_shares(PARAMETERS, {py(prefix)}, {py(share.rows[0])})")
                rows = share.rows[0]
                if count == len(chunk) and not isinstance(rows, int):
                    only = prefix, rows
                del items[:count]
                continue
            args = [py(share.stored)]
            if share.rows:
                args.append(py(share.rows))
            if placement.array(share.stored).rows:
                args.append("shape=" + py(share.shape))
            entries.append(f"{py(name)}: Share({', '.join(args)})")
            del items[0]
        out.append((entries, only))
    return out


def _layers_of_repeat(placement: Placement, items: list[tuple[str, Share]]) -> tuple[str, int] | None:
    """(prefix, count) where `items` start with what `layer_shares(PARAMETERS, prefix, rows)`
    makes: the same layers of every array stored under a repeat's prefix (`blocks.*.`), in
    the table's order; else None."""
    name, share = items[0]
    if ".*." not in name or len(share.rows) != 1 or isinstance(share.rows[0], int):
        return None
    prefix = name[: name.index(".*.") + 3]
    arrays = [a for a in placement.arrays if a.name.startswith(prefix)]
    made = [(a.name, a.name, share.rows) for a in arrays]
    if any(a.rows for a in arrays) or [(n, s.stored, s.rows) for n, s in items[: len(made)]] != made:
        return None
    return prefix, len(arrays)


def _inputs(program: ir.Program, builder: Builder) -> list[dict[str, object]]:
    bounds = integer_bounds(program)
    return [
        {
            "name": i.name,
            "shape": Code(_tuple([(builder.code(w) if w else None) or str(n) for n, w in _dims(i)])),
            "dtype": ir.DTYPES[i.type.dtype].jax,
            "sharding": i.type.sharding,
            "bound": bounds.get(i.name, 2),
            "source": builder.where(i.span),
        }
        for i in program.inputs
    ]


def _dims(i: ir.Input) -> list[tuple[int, str]]:
    """Each dimension of an input with how the spec wrote it ("" where it is not known)."""
    written = i.written or ("",) * i.type.rank
    return list(zip(i.type.shape, written, strict=True))


def _schedule(program: ir.Program) -> dict[str, object]:
    p = program.pipeline
    assert p is not None
    stages = program.stages
    shape, dtype = boundary_of(program, p.microbatches)
    schedule = schedule_of(program).table()
    timeline = to_text(schedule).rstrip("\n").split("\n")
    command = f"dslc schedule --kind {p.schedule} --stages {stages} --microbatches {p.microbatches}"
    return {
        # The timeline as `dslc schedule` draws it, where it fits in a comment; else the
        # command that draws it.
        "timeline": timeline if max(map(len, timeline)) <= 110 else [],
        "draw": f"{command} --virtual {p.virtual}",
        "kind": p.schedule,
        "stages": stages,
        "microbatches": p.microbatches,
        "virtual": p.virtual,
        "axis": p.axis,
        "timelines": [_wrapped(pieces) for pieces in timelines(schedule)],
        "chunk_inputs": [chunk_input(chunk, p.microbatches) for chunk in program.chunks],
        "boundary_shape": shape,
        "boundary_dtype": ir.DTYPES[dtype or program.train.compute_dtype].jax,
    }


def _wrapped(pieces: tuple[str, ...], width: int = 100) -> list[str]:
    """A stage's timeline as string literals of at most about `width` characters that
    concatenate to it, split between its pieces."""
    lines: list[list[str]] = [[]]
    for piece in pieces:
        if lines[-1] and len(" ".join([*lines[-1], piece])) > width:
            lines.append([])
        lines[-1].append(piece)
    return [py(" ".join(line) + " ") for line in lines[:-1]] + [py(" ".join(lines[-1]))]


def _kernel_names() -> set[str]:
    return set(source.all_definitions())


def _imports(text: str) -> list[str]:
    """The import lines a module's code needs: the runtime names it uses, each from the
    runtime module that defines it, and the libraries it names."""
    tree = ast.parse(text)
    defined = {getattr(n, "id", None) or getattr(n, "name", "") for n in _top_level_definitions(tree)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined
    runtime = source.all_definitions()
    lines = {source.PRELUDE_IMPORTS[n] for n in used & set(source.PRELUDE_IMPORTS)}
    lines |= {f"from {source.RUNTIME}.{runtime[n].module} import {n}" for n in used & set(runtime)}
    if "P" in used:  # the module's own name for the specs it writes
        lines.add("from jax.sharding import PartitionSpec as P")
    return sorted(lines)  # in any order: the layout sorts and merges them


def _top_level_definitions(tree: ast.Module) -> list[ast.AST]:
    """The names a module's top level binds: its functions, classes and assigned names."""
    found: list[ast.AST] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend(n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return found
