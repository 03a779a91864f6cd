"""The `dslc` command.

Exit codes: 0 success (warnings allowed), 1 the spec has errors, 2 usage error (bad flags,
missing file). Anything else escaping is a bug in dslc, and is reported as one.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dslc import files, resources
from dslc.diagnostics import Severity, render_json, render_text
from dslc.frontend import Analysis, analyze

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message
        return int(exc.code or 0) and EXIT_USAGE
    try:
        command: Callable[[argparse.Namespace], int] = args.run
        return command(args)
    except UsageError as exc:
        print(f"dslc: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _Exit as exc:
        return exc.code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(
            f"dslc: internal error: {type(exc).__name__}: {exc}\n"
            "This is a bug in dslc, not in your spec. Please file a report with the spec and the "
            "command line that triggered it.",
            file=sys.stderr,
        )
        if os.environ.get("DSLC_TRACEBACK"):
            traceback.print_exc()
        else:
            print("(set DSLC_TRACEBACK=1 to include the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dslc", description="Compiler for model-parallel training plans (.par files)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="check a spec and report every problem with it")
    _spec_arg(check)
    check.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    check.add_argument("--format", choices=("text", "json"), default="text")
    _set_arg(check)
    check.set_defaults(run=_check)

    fmt = sub.add_parser("fmt", help="rewrite a spec in canonical form (comments kept)")
    fmt.add_argument("spec", help="path of the .par file")
    fmt.add_argument("--check", action="store_true", help="only report whether the file is formatted")
    fmt.add_argument("--stdout", action="store_true", help="print the formatted text instead of rewriting")
    fmt.set_defaults(run=_fmt)

    init = sub.add_parser("init", help="initialise a spec's weights on a mesh and save them (.npz)")
    init.add_argument("spec", help="path of the .par file")
    init.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("-o", "--output", required=True, help="where to write the weights (.npz)")
    _set_arg(init)
    init.set_defaults(run=_init)

    run = sub.add_parser("run", help="run the forward pass (and with --grads, the loss and gradients)")
    run.add_argument("spec", help="path of the .par file")
    run.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    run.add_argument("--weights", required=True, help="weights (.npz, as written by `dslc init`)")
    run.add_argument("--inputs", required=True, help="inputs (.npz, one array per declared input)")
    run.add_argument("-o", "--output", required=True, help="where to write the results (.npz)")
    run.add_argument("--grads", action="store_true", help="also write `loss` and `grad/NAME` for every weight")
    _set_arg(run)
    run.set_defaults(run=_run)

    plan = sub.add_parser("plan", help="memory, communication, bubble and FLOPs per device, before anything runs")
    plan.add_argument("spec", help="path of the .par file")
    plan.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.add_argument("--device-memory", type=float, metavar="GiB", help="warn when a device needs more than this")
    _set_arg(plan)
    plan.set_defaults(run=_plan)

    train = sub.add_parser("train", help="train a spec on embedded data, with metrics and checkpoints")
    _spec_arg(train)
    train.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    train.add_argument("--steps", type=_count, required=True, help="train until this many optimizer steps are done")
    train.add_argument("--seed", type=_count, help="weights and data order (default 0; --resume keeps the run's own)")
    train.add_argument("--out", help="run folder: metrics.jsonl, loss.png, checkpoints/ (default runs/MODEL)")
    train.add_argument(
        "--checkpoint-every", type=_count, metavar="K", help="also checkpoint every K steps (always at the end)"
    )
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    _set_arg(train)
    train.set_defaults(run=_train)

    sched = sub.add_parser("schedule", help="print, draw or export a pipeline schedule table")
    sched.add_argument("--kind", required=True, help="gpipe, 1f1b, interleaved-1f1b or zb-h1")
    sched.add_argument("--stages", type=int, required=True)
    sched.add_argument("--microbatches", type=int, required=True)
    sched.add_argument("--virtual", type=int, default=1)
    sched.add_argument("--format", choices=("text", "json", "svg"), default="text")
    sched.set_defaults(run=_schedule)
    return parser


def _spec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "spec",
        nargs="?",
        help=f"path of the .par file (default: the embedded {resources.DEFAULT_SPEC})",
    )


def _set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", help="replace the spec's pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a constant of the spec, e.g. --set layers=4 (repeatable)",
    )


def _spec_path(args: argparse.Namespace) -> Path:
    path = Path(args.spec) if args.spec else resources.default_spec_path()
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    return path


def _analyze(args: argparse.Namespace) -> Analysis:
    path = _spec_path(args)
    try:
        return analyze(path, args.mesh, args.set, args.schedule)
    except ValueError as exc:  # a malformed --mesh or --set
        raise UsageError(str(exc)) from None


def _check(args: argparse.Namespace) -> int:
    result = _analyze(args)
    diags = result.diagnostics
    if args.format == "json":
        sys.stdout.write(render_json(diags))
    else:
        sources = {result.source.name: result.source.text} if result.source else {}
        if diags:
            sys.stderr.write(render_text(diags, sources))
        errors = sum(d.severity is Severity.ERROR for d in diags)
        warnings = len(diags) - errors
        name = result.source.name if result.source else args.spec
        if errors:
            print(
                f"{name}: {errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}",
                file=sys.stderr,
            )
        else:
            print(
                f"{name}: ok{_summary(result)}" + (f", {warnings} warning{'s' * (warnings != 1)}" if warnings else "")
            )
    return EXIT_ERRORS if any(d.severity is Severity.ERROR for d in diags) else EXIT_OK


def _summary(result: Analysis) -> str:
    from dslc.ir.nodes import all_layers, weights_by_path

    program = result.program
    if program is None:
        return ""
    params = sum(w.type.numel for w in weights_by_path(program).values())
    return (
        f" — model {program.name}, {len(all_layers(program))} layers, {params:,} parameters, "
        f"mesh {program.mesh.describe()}"
    )


def _fmt(args: argparse.Namespace) -> int:
    from dslc.syntax.format import format_module
    from dslc.syntax.parser import parse
    from dslc.syntax.source import read_path

    path = Path(args.spec)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    source, diags = read_path(path)
    module = None
    if source is not None:
        module, diags = parse(source)
    if source is None or module is None:
        sys.stderr.write(render_text(diags, {source.name: source.text} if source else {}))
        return EXIT_ERRORS
    formatted = format_module(module, source.text)
    if args.stdout:
        sys.stdout.write(formatted)
        return EXIT_OK
    if formatted == source.text:
        return EXIT_OK
    if args.check:
        print(f"{path}: would be reformatted", file=sys.stderr)
        return EXIT_ERRORS
    write_atomic(path, formatted)
    print(f"{path}: reformatted")
    return EXIT_OK


def write_atomic(path: Path, content: str | bytes) -> None:
    """`dslc.files.write_atomic`, with a missing folder reported as a usage error."""
    try:
        files.write_atomic(path, content)
    except files.FolderMissing as exc:
        raise UsageError(str(exc)) from None


def _compile(args: argparse.Namespace) -> Any:
    """The spec as a Program, or the exit that explains why not."""
    from dslc.frontend import CompileError
    from dslc.lower import compile
    from dslc.lower.devices import DeviceError

    path = _spec_path(args)
    try:
        return compile(path, args.mesh, args.set, args.schedule)
    except ValueError as exc:  # a malformed --mesh or --set
        raise UsageError(str(exc)) from None
    except CompileError as exc:
        sys.stderr.write(str(exc) + "\n")
        raise _Exit(EXIT_ERRORS) from None
    except DeviceError as exc:
        print(f"dslc: error: {exc}", file=sys.stderr)
        raise _Exit(EXIT_ERRORS) from None


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _load_npz(path_text: str, what: str) -> dict[str, Any]:
    import numpy as np

    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        print(f"dslc: error: cannot read {what} from {path}: {exc}", file=sys.stderr)
        raise _Exit(EXIT_ERRORS) from None


def _save_npz(path_text: str, arrays: dict[str, Any]) -> None:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(Path(path_text), buffer.getvalue())


def _init(args: argparse.Namespace) -> int:
    program = _compile(args)
    model = program.init(args.seed)
    weights = program.export_weights(model)
    _save_npz(args.output, weights)
    print(f"{args.output}: {len(weights)} weights, {sum(w.size for w in weights.values()):,} parameters")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    program = _compile(args)  # first: it decides how many host devices jax starts with
    from dslc.lower.program import WeightsError

    weights = _load_npz(args.weights, "weights")
    inputs = _load_npz(args.inputs, "inputs")
    model = program.init(0)
    try:
        program.import_weights(model, weights)
        results = {"output": program.forward(model, inputs)}
        if args.grads:
            results["loss"] = program.loss(model, inputs)
            results.update({f"grad/{name}": g for name, g in program.grads(model, inputs).items()})
    except (WeightsError, ValueError) as exc:
        print(f"dslc: error: {exc}", file=sys.stderr)
        return EXIT_ERRORS
    import numpy as np

    _save_npz(args.output, {name: np.asarray(value) for name, value in results.items()})
    print(f"{args.output}: " + ", ".join(sorted(results)[:4]) + (", ..." if len(results) > 4 else ""))
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    import json

    from dslc.plan import plan

    if args.device_memory is not None and not args.device_memory > 0:
        raise UsageError(f"--device-memory must be a positive number of GiB, got {args.device_memory}")
    result = _analyze(args)
    if not result.ok:
        sources = {result.source.name: result.source.text} if result.source else {}
        sys.stderr.write(render_text(result.diagnostics, sources))
        return EXIT_ERRORS
    assert result.program is not None
    limit = None if args.device_memory is None else int(args.device_memory * (1 << 30))
    report = plan(result.program, limit)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        sys.stdout.write(report.to_text())
    return EXIT_OK


def _count(text: str) -> int:
    """A whole number for --steps, --seed and --checkpoint-every (0 only for --seed)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def _train(args: argparse.Namespace) -> int:
    if args.steps == 0 or args.checkpoint_every == 0:
        raise UsageError("--steps and --checkpoint-every must be at least 1")
    program = _compile(args)  # first: it decides how many host devices jax starts with
    from dslc.train.dataset import DataError
    from dslc.train.loop import TrainError, TrainOptions, train

    out = Path(args.out) if args.out else Path("runs") / program.ir.name
    options = TrainOptions(args.steps, out, args.seed, args.checkpoint_every, args.resume)
    try:
        result = train(program, options)
    except (DataError, TrainError) as exc:
        raise UsageError(str(exc)) from None
    print(result.summary())
    return EXIT_OK


def _schedule(args: argparse.Namespace) -> int:
    import json

    from dslc.schedules import ScheduleError, build
    from dslc.schedules.render import to_json, to_svg, to_text

    try:
        schedule = build(args.kind, args.stages, args.microbatches, args.virtual)
    except ScheduleError as exc:
        raise UsageError(str(exc)) from None
    match args.format:
        case "json":
            print(json.dumps(to_json(schedule), indent=2))
        case "svg":
            sys.stdout.write(to_svg(schedule))
        case _:
            sys.stdout.write(to_text(schedule))
    return EXIT_OK


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
