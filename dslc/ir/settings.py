"""The plan's settings: the `pipeline` and `train` sections."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, TypedDict

from dslc.diagnostics import Diagnostics, Label
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue, eval_expr, eval_value
from dslc.ir.names import closest, unknown_name
from dslc.schedules import KINDS as SCHEDULES
from dslc.schedules import Schedule, ScheduleError, build, default_virtual
from dslc.schedules.from_json import TableError, read_table
from dslc.syntax import ast

PRECISIONS = ("f32", "bf16", "f16")

# The hyperparameters each optimizer accepts (all numbers); the training loop reads them.
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw": ("lr", "b1", "b2", "eps", "weight_decay", "warmup", "decay_steps", "clip"),
    "adam": ("lr", "b1", "b2", "eps", "warmup", "decay_steps", "clip"),
    "sgd": ("lr", "momentum", "warmup", "decay_steps", "clip"),
}


def _unique(settings: tuple[ast.PipelineItem, ...], diags: Diagnostics) -> dict[str, ast.PipelineItem]:
    seen: dict[str, ast.PipelineItem] = {}
    for s in settings:
        key = s.key.text if isinstance(s, ast.Setting) else "schedule"
        if key in seen:
            diags.error("E011", f"`{key}` is set twice", s.span, labels=[Label(seen[key].span, "first set here")])
            continue
        seen[key] = s
    return seen


def _one_int(
    s: ast.Setting, constants: Mapping[str, ScalarValue], diags: Diagnostics, lo: int, hi: int | None = None
) -> int | None:
    if len(s.values) != 1 or isinstance(s.values[0], ast.Call | ast.FloatLit | ast.BoolLit):
        diags.error("E026", f"`{s.key.text}` takes one integer", s.span)
        return None
    value = eval_expr(s.values[0], constants, diags)
    if value is None:
        return None
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        diags.error("E026", f"`{s.key.text}` must be {bounds}, got {value}", s.values[0].span)
        return None
    return value


def _unknown_key(s: ast.Setting, known: tuple[str, ...], section: str, diags: Diagnostics) -> None:
    diags.add(unknown_name(f"`{section}` setting", s.key.text, s.key.span, known, code="E026"))


def read_pipeline(
    p: ast.PipelineDef, mesh: ir.Mesh, constants: Mapping[str, ScalarValue], diags: Diagnostics
) -> ir.Pipeline | None:
    """The `pipeline` section; its numbers are integer expressions over the spec's constants."""
    axis = p.axis.text
    if axis not in mesh.names:
        diags.add(unknown_name("mesh axis", axis, p.axis.span, mesh.names, code="E012"))
        return None
    settings = _unique(p.items, diags)
    schedule = "1f1b"
    table: Schedule | None = None
    microbatches: int | None = None
    virtual: int | None = None
    for key, s in settings.items():
        match s:
            case ast.ScheduleSetting(kind=kind):
                schedule = kind.text
                if schedule not in SCHEDULES:
                    guess = closest(schedule, SCHEDULES)
                    diags.error(
                        "E021",
                        f"unknown pipeline schedule `{schedule}`",
                        kind.span,
                        notes=["schedules: " + ", ".join(SCHEDULES)],
                        help=f"did you mean `{guess}`?" if guess else None,
                    )
            case ast.ScheduleFile():
                table = _schedule_file(s, diags)
                if table is None:
                    return None
                schedule = table.kind
            case ast.Setting() if key == "microbatches":
                microbatches = _one_int(s, constants, diags, 1, 1 << 20)
            case ast.Setting() if key == "virtual":
                virtual = _one_int(s, constants, diags, 1, 64) or 1
            case ast.Setting():
                _unknown_key(s, ("schedule", "microbatches", "virtual"), "pipeline", diags)
    if table is not None:
        written = {"microbatches": microbatches, "virtual": virtual}
        if not _fits_the_pipeline(table, settings, written, mesh.size((axis,)), axis, diags):
            return None
        microbatches, virtual = table.microbatches, table.virtual
        if _built_in(table):
            table = None  # the saved table of a built-in kind is that kind: same plan, same numbers
    if microbatches is None:
        if "microbatches" not in settings:
            diags.error(
                "E026",
                "the pipeline needs `microbatches N`",
                p.span,
                help="at least 4 per stage keeps the bubble small",
            )
        return None
    if virtual is None:
        virtual = default_virtual(schedule) if schedule in SCHEDULES else 1
    return ir.Pipeline(axis, schedule, microbatches, virtual, p.span, table)


def _schedule_file(s: ast.ScheduleFile, diags: Diagnostics) -> Schedule | None:
    """The table `s` names, relative to the spec's folder; None when it cannot run (reported)."""
    path = Path(s.span.file).parent / s.path
    try:
        return read_table(path)
    except TableError as exc:
        diags.error(
            "E030",
            exc.message,
            s.span,
            notes=list(exc.problems),
            help="`dslc schedule --kind KIND --stages P --microbatches M --format json` prints a table to start from",
        )
        return None


def _built_in(table: Schedule) -> bool:
    """Whether `table` is what `build` makes for its kind (as `dslc schedule` saved it)."""
    if table.kind not in SCHEDULES:
        return False
    try:
        return build(table.kind, table.stages, table.microbatches, table.virtual) == table
    except ScheduleError:
        return False


def _fits_the_pipeline(
    table: Schedule,
    settings: dict[str, ast.PipelineItem],
    written: dict[str, int | None],
    stages: int,
    axis: str,
    diags: Diagnostics,
) -> bool:
    """Whether the table is for this pipeline: its stages, and the microbatches and chunks per
    stage the section writes, if it writes them (the table's own are the default)."""
    read_here = settings["schedule"].span
    fits = True
    if table.stages != stages:
        fits = False
        diags.error(
            "E030",
            f"the schedule table is for {table.stages} stages, but the pipeline axis `{axis}` has {stages}",
            read_here,
            help=f"make a table for {stages} stages with `dslc schedule`, or give `{axis}` {table.stages} devices",
        )
    for key, value in written.items():
        own = getattr(table, key)
        if value is not None and value != own:
            fits = False
            diags.error(
                "E030",
                f"the schedule table has {key} {own}, but the pipeline sets {key} {value}",
                settings[key].span,
                labels=[Label(read_here, "the table is read here")],
                help=f"leave `{key}` out (the table's is the default), or make a table with {key} {value}",
            )
    return fits


class _TrainFields(TypedDict, total=False):
    """The `ir.Train` fields a `train` section sets; the others keep their defaults."""

    zero: int
    shard_axes: ir.Axes
    accumulate: int
    param_dtype: str
    compute_dtype: str
    master_dtype: str
    grad_dtype: str
    optimizer: ir.Optimizer


def read_train(t: ast.TrainDef, mesh: ir.Mesh, constants: Mapping[str, ScalarValue], diags: Diagnostics) -> ir.Train:
    """The `train` section; its numbers are expressions over the spec's constants."""
    settings = _unique(t.settings, diags)
    train = ir.Train(span=t.span)
    fields: _TrainFields = {}

    def zero(s: ast.Setting) -> None:
        value = _one_int(s, constants, diags, 0, 3)
        if value is not None:
            fields["zero"] = value

    def fsdp(s: ast.Setting) -> None:
        axes = []
        for v in s.values:
            if not isinstance(v, ast.NameRef):
                diags.error(
                    "E026",
                    "`fsdp` takes the mesh axes to shard parameters over",
                    v.span,
                    help="for example `fsdp data`",
                )
                return
            if v.name not in mesh.names:
                diags.add(unknown_name("mesh axis", v.name, v.span, mesh.names, code="E012"))
                return
            axes.append(v.name)
        fields["shard_axes"] = tuple(axes)
        fields["zero"] = 3

    def accumulate(s: ast.Setting) -> None:
        value = _one_int(s, constants, diags, 1, 1 << 16)
        if value is not None:
            fields["accumulate"] = value

    def precision(key: Literal["param_dtype", "compute_dtype", "master_dtype", "grad_dtype"], s: ast.Setting) -> None:
        v = s.values[0] if len(s.values) == 1 else None
        if not isinstance(v, ast.NameRef):
            # Not a name at all (a number, a call, several values): nothing to suggest from.
            diags.error(
                "E026",
                f"`{s.key.text}` takes one precision: {', '.join(PRECISIONS)}",
                v.span if v is not None else s.span,
                help=f"for example `{s.key.text} bf16`",
            )
            return
        if v.name not in PRECISIONS:
            diags.add(unknown_name("precision", v.name, v.span, PRECISIONS, code="E026"))
            return
        fields[key] = v.name

    def optimizer(s: ast.Setting) -> None:
        v = s.values[0] if len(s.values) == 1 else None
        if isinstance(v, ast.NameRef):
            v = ast.Call(ast.Ident(v.name, v.span), (), v.span)
        if not isinstance(v, ast.Call):
            diags.error("E026", "`optimizer` takes one optimizer, for example `optimizer adamw(lr=3e-4)`", s.span)
            return
        name = v.callee.text
        if name not in OPTIMIZERS:
            diags.add(unknown_name("optimizer", name, v.callee.span, OPTIMIZERS, code="E026"))
            return
        hyper: dict[str, float] = {}
        for arg in v.args:
            if arg.name is None:
                diags.error("E026", "optimizer settings are named, for example `lr=3e-4`", arg.span)
                continue
            if arg.name.text not in OPTIMIZERS[name]:
                diags.add(
                    unknown_name(f"`{name}` setting", arg.name.text, arg.name.span, OPTIMIZERS[name], code="E026")
                )
                continue
            value = eval_value(arg.value, constants, diags)
            if value is None or isinstance(value, bool):
                if isinstance(value, bool):
                    diags.error("E026", f"`{arg.name.text}` is a number", arg.value.span)
                continue
            hyper[arg.name.text] = float(value)
        fields["optimizer"] = ir.Optimizer(name, tuple(hyper.items()))

    readers: dict[str, Callable[[ast.Setting], None]] = {
        "zero": zero,
        "fsdp": fsdp,
        "accumulate": accumulate,
        "param_dtype": lambda s: precision("param_dtype", s),
        "compute_dtype": lambda s: precision("compute_dtype", s),
        "master_dtype": lambda s: precision("master_dtype", s),
        "grad_dtype": lambda s: precision("grad_dtype", s),
        "optimizer": optimizer,
    }
    for key, s in settings.items():
        assert isinstance(s, ast.Setting)
        if key in readers:
            readers[key](s)
        else:
            _unknown_key(s, tuple(readers), "train", diags)
    if "zero" in settings and "fsdp" in settings:
        diags.error(
            "E026",
            "`fsdp` is ZeRO stage 3 over the axes it names; give `zero` or `fsdp`, not both",
            settings["fsdp"].span,
            labels=[Label(settings["zero"].span, "zero stage set here")],
        )
    for wide in ("master_dtype", "grad_dtype"):
        if wide in fields:
            _check_wide(wide, settings, fields, diags)
    return ir.Train(
        zero=fields.get("zero", train.zero),
        shard_axes=fields.get("shard_axes", train.shard_axes),
        accumulate=fields.get("accumulate", train.accumulate),
        param_dtype=fields.get("param_dtype", train.param_dtype),
        compute_dtype=fields.get("compute_dtype", train.compute_dtype),
        master_dtype=fields.get("master_dtype", train.master_dtype),
        grad_dtype=fields.get("grad_dtype", train.grad_dtype),
        optimizer=fields.get("optimizer", train.optimizer),
        span=t.span,
    )


# What each f32 copy beside 16-bit parameters keeps, as the diagnostics say it.
_WIDE = {
    "master_dtype": ("keeps an f32 master copy of 16-bit parameters", "the master in the optimizer state"),
    "grad_dtype": ("sums the gradients of 16-bit parameters in f32", "their gradients summed in f32"),
}


def _check_wide(
    key: Literal["master_dtype", "grad_dtype"],
    settings: dict[str, ast.PipelineItem],
    fields: _TrainFields,
    diags: Diagnostics,
) -> None:
    """`master_dtype` keeps an f32 master copy of 16-bit parameters in the optimizer state, and
    `grad_dtype` sums their gradients in f32: each must be f32, and the parameters narrower. A
    setting that does not fit is dropped."""
    where = settings[key]
    assert isinstance(where, ast.Setting)
    param = fields.get("param_dtype", ir.Train().param_dtype)
    does, kept = _WIDE[key]
    if fields[key] != "f32":
        diags.error(
            "E026",
            f"`{key}` {does}: it is f32, not {fields[key]}",
            where.values[0].span,
            help=f"write `{key} f32`",
        )
        del fields[key]
    elif param == "f32":
        written = settings.get("param_dtype")
        labels = [Label(written.span, "parameters kept in f32 here")] if written is not None else []
        diags.error(
            "E026",
            f"`{key} f32` {does}, but the parameters are f32 and so is everything computed from them",
            where.span,
            labels=labels,
            notes=["parameters are f32 unless `param_dtype` says otherwise"] if not labels else [],
            help=f"add `param_dtype bf16` (parameters in 16 bits, {kept}), or leave `{key}` out",
        )
        del fields[key]
