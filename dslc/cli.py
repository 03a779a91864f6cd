"""The `dslc` command.

Exit codes: 0 success (warnings allowed), 1 the spec has errors, 2 usage error (bad flags,
missing file). Anything else escaping is a bug in dslc, and is reported as one.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslc import files, resources
from dslc.diagnostics import Severity, render_json, render_text
from dslc.frontend import Analysis, analyze

if TYPE_CHECKING:
    from dslc.interop import CheckpointError

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by Ctrl-C


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
        return EXIT_INTERRUPTED
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
    parser.add_argument("--version", action="version", version=f"dslc {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="check a spec and report every problem with it")
    _spec_arg(check)
    check.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    check.add_argument(
        "--format", choices=("text", "json"), default="text", help="diagnostics as text (stderr) or JSON (stdout)"
    )
    check.add_argument(
        "--backend",
        choices=("cpu", "gpu", "tpu"),
        help="also say which kernel each attention layer runs there, and warn (W005) where no fused one can",
    )
    _set_arg(check)
    check.set_defaults(run=_check)

    fmt = sub.add_parser("fmt", help="rewrite a spec in canonical form (comments kept)")
    fmt.add_argument("spec", help="path of the .par file")
    fmt.add_argument("--check", action="store_true", help="only report whether the file is formatted")
    fmt.add_argument("--stdout", action="store_true", help="print the formatted text instead of rewriting")
    fmt.set_defaults(run=_fmt)

    comp = sub.add_parser("compile", help="write a spec as a standalone, readable Python module (jax, flax, optax)")
    _spec_arg(comp)
    comp.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    comp.add_argument("-o", "--output", help="where to write the module (default: SPEC_NAME.py here)")
    comp.add_argument("--force", action="store_true", help="overwrite a file that `dslc compile` did not write")
    _set_arg(comp)
    comp.set_defaults(run=_compile_to_python)

    init = sub.add_parser("init", help="initialise a spec's weights on a mesh and save them (.npz)")
    init.add_argument("spec", help="path of the .par file")
    init.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    init.add_argument("--seed", type=_count, default=0, help="the weights' random seed, a whole number (default 0)")
    init.add_argument(
        "-o", "--output", required=True, help="where to write the weights (.npz; bfloat16 weights as float32, exactly)"
    )
    _set_arg(init)
    init.set_defaults(run=_init)

    run = sub.add_parser("run", help="run the forward pass (and with --grads, the loss and gradients)")
    run.add_argument("spec", help="path of the .par file")
    run.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    run.add_argument(
        "--weights", required=True, help="weights: a .npz (dslc init, dslc import) or a `dslc train` run folder"
    )
    run.add_argument("--inputs", required=True, help="inputs (.npz, one array per declared input)")
    run.add_argument(
        "-o",
        "--output",
        required=True,
        help="where to write the results (.npz; bfloat16 results are written as float32, which numpy reads)",
    )
    run.add_argument("--grads", action="store_true", help="also write `loss` and `grad/NAME` for every weight")
    _set_arg(run)
    run.set_defaults(run=_run)

    imp = sub.add_parser(
        "import",
        help="read a Hugging Face checkpoint folder (GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE, "
        "Qwen2-MoE, GPT-NeoX/Pythia, Gemma 2, ViT, T5/Flan-T5) into a spec's weights",
    )
    imp.add_argument("spec", help="path of the .par file")
    imp.add_argument("checkpoint", help="the checkpoint folder: config.json and .safetensors files")
    imp.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    imp.add_argument("-o", "--output", required=True, help="where to write the weights (.npz)")
    _set_arg(imp)
    imp.set_defaults(run=_import)

    exp = sub.add_parser("export", help="write a spec's weights as a Hugging Face checkpoint folder")
    exp.add_argument("spec", help="path of the .par file")
    exp.add_argument(
        "--weights", required=True, help="weights: a .npz (dslc init, dslc import) or a `dslc train` run folder"
    )
    exp.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    exp.add_argument("-o", "--output", required=True, help="the folder to write config.json and model.safetensors in")
    exp.add_argument("--dtype", choices=("f32", "bf16", "f16"), help="the tensors' dtype (default: the spec's)")
    exp.add_argument(
        "--untie", action="store_true", help="write a head tied to the embedding as its own weight, when they differ"
    )
    _set_arg(exp)
    exp.set_defaults(run=_export)

    plan = sub.add_parser("plan", help="memory, communication, bubble and FLOPs per device, before anything runs")
    plan.add_argument("spec", help="path of the .par file")
    plan.add_argument(
        "--mesh",
        help="mesh sizes in the spec's axis order, e.g. 2x4x2; `auto` chooses them, with the pipeline "
        "schedule and microbatches (needs --devices and --device-memory)",
    )
    plan.add_argument("--format", choices=("text", "json"), default="text", help="a report (text) or one JSON object")
    plan.add_argument(
        "--device-memory", type=float, metavar="GiB", help="warn when a device needs more than this (auto: the limit)"
    )
    plan.add_argument(
        "--xla",
        action="store_true",
        help="also compile the gradient and training steps for the mesh on this machine and show XLA's "
        "memory analysis next to the plan (imports jax; on a CPU-only machine the devices are simulated)",
    )
    auto = plan.add_argument_group(
        "the step-time estimate, and --mesh auto (the cost model's defaults are in docs/plan.md)"
    )
    auto.add_argument("--devices", type=int, metavar="N", help="--mesh auto: how many devices to plan for")
    auto.add_argument(
        "--measure",
        type=_count,
        metavar="K",
        help="--mesh auto: also compile the K fastest plans that fit here and show XLA's memory beside the plan's",
    )
    auto.add_argument("--device-flops", type=float, metavar="TFLOPS", help="effective TFLOP/s per device (300)")
    auto.add_argument("--intra-bandwidth", type=float, metavar="GBps", help="GB/s between devices of a node (300)")
    auto.add_argument("--inter-bandwidth", type=float, metavar="GBps", help="GB/s between nodes (25)")
    auto.add_argument("--node-size", type=int, metavar="N", help="devices per node (8)")
    auto.add_argument("--intra-latency", type=float, metavar="US", help="µs per collective call inside a node (10)")
    auto.add_argument("--inter-latency", type=float, metavar="US", help="µs per collective call between nodes (20)")
    auto.add_argument(
        "--no-overlap",
        action="store_true",
        help="cost every collective as exposed, as on a backend that overlaps none with compute (by default, "
        "ZeRO-3's gathers and layer-by-layer gradient reductions run under the compute, as dslc train's XLA flags "
        "make them on GPUs and TPUs)",
    )
    _set_arg(plan)
    plan.set_defaults(run=_plan)

    show = sub.add_parser(
        "show",
        help="every weight and activation with its sharding, per-device shape and bytes, and each layer's collectives",
    )
    _spec_arg(show)
    show.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    show.add_argument("--format", choices=("text", "json"), default="text", help="a table (text) or one JSON object")
    _set_arg(show)
    show.set_defaults(run=_show)

    train = sub.add_parser("train", help="train a spec on embedded data, with metrics and checkpoints")
    _spec_arg(train)
    train.add_argument("--mesh", help="mesh sizes in the spec's axis order, e.g. 2x4x2")
    train.add_argument("--steps", type=_count, required=True, help="train until this many optimizer steps are done")
    train.add_argument("--seed", type=_count, help="weights and data order (default 0; --resume keeps the run's own)")
    train.add_argument("--out", help="run folder: metrics.jsonl, loss.png, checkpoints/ (default runs/MODEL)")
    train.add_argument(
        "--checkpoint-every", type=_count, metavar="K", help="also checkpoint every K steps (always at the end)"
    )
    train.add_argument(
        "--device-flops",
        type=float,
        metavar="TFLOPS",
        help="the dense peak TFLOP/s per device MFU is measured against (default: the datasheet's for the "
        "device and compute dtype; none on CPUs, whose MFU is then not reported)",
    )
    train.add_argument(
        "--profile",
        type=_profile_steps,
        metavar="START:STOP",
        help="trace steps START to STOP with the JAX profiler into RUN/profile, for TensorBoard's profile plugin "
        "and ui.perfetto.dev",
    )
    train.add_argument(
        "--wandb",
        action="store_true",
        help="also log every scalar to a Weights & Biases run (needs the wandb package; WANDB_MODE=offline "
        "works without a network)",
    )
    train.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write each checkpoint before the next step starts (by default, while the next steps compute)",
    )
    train.add_argument(
        "--no-overlap-flags",
        action="store_true",
        help="leave out the XLA flags that overlap collectives with compute on GPUs and TPUs (set by default, "
        "each unless XLA_FLAGS or LIBTPU_INIT_ARGS already names it; docs/training.md lists them)",
    )
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run folder")
    train.add_argument(
        "--auto-resume",
        action="store_true",
        help="continue from the newest checkpoint in the run folder if it holds one, else start: one command for "
        "every (re)start of a preemptible job (the run folder defaults to runs/MODEL)",
    )
    train.add_argument(
        "--data",
        metavar="PATH",
        help="a language model's own data: a token file (.bin uint16, or .npy), a folder with train.bin and "
        "val.bin, or text files or a folder of them (byte-level); an image classifier's: an .npz holding `images` "
        "and `labels`, a folder with images.npy and labels.npy, or a folder with a sub-folder of images per class; "
        "default: the embedded data",
    )
    train.add_argument(
        "--document-end",
        type=_count,
        metavar="ID",
        help="in a token file, the id that ends each document (a folder's text files are a document each); a spec "
        "whose attention reads document ids (`segments=`) trains on sequences packed from several",
    )
    train.add_argument(
        "--eval-every", type=_count, metavar="K", help="log the loss on held-out data every K steps and at the end"
    )
    train.add_argument(
        "--init-from",
        metavar="WEIGHTS",
        help="start from these weights: a .npz (dslc init, dslc import) or a Hugging Face checkpoint folder",
    )
    train.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: the address of process 0")
    train.add_argument("--num-processes", type=_count, metavar="N", help="multi-process run: how many processes")
    train.add_argument("--process-id", type=_count, metavar="I", help="multi-process run: this one's, 0 to N-1")
    _set_arg(train)
    train.set_defaults(run=_train)

    sched = sub.add_parser("schedule", help="print, draw or export a pipeline schedule table")
    sched.add_argument(
        "--kind", required=True, help="the schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v or v-half"
    )
    sched.add_argument(
        "--stages", type=int, required=True, metavar="P", help="pipeline stages (devices along the axis)"
    )
    sched.add_argument(
        "--microbatches", type=int, required=True, metavar="M", help="microbatches each step's batch is cut into"
    )
    sched.add_argument(
        "--virtual",
        type=int,
        metavar="V",
        help="model chunks per stage: 2 or more for interleaved-1f1b (default: the kind's own)",
    )
    sched.add_argument(
        "--format",
        choices=("text", "json", "svg"),
        default="text",
        help="a timeline, the table as JSON (which `--schedule FILE.json` and `schedule file` read back), or a picture",
    )
    sched.set_defaults(run=_schedule)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dslc")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _spec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "spec",
        nargs="?",
        help=f"path of the .par file (default: the embedded {resources.DEFAULT_SPEC})",
    )


def _set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--schedule",
        metavar="KIND|FILE.json",
        help="replace the spec's pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, v-half, or a table "
        "in the JSON `dslc schedule --format json` prints",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a constant of the spec, e.g. --set layers=4, --set eps=1e-6, --set tied=true (repeatable)",
    )


def _spec_path(args: argparse.Namespace) -> Path:
    return _existing_file(args.spec) if args.spec else resources.default_spec_path()


def _existing_file(text: str) -> Path:
    """A path the user named as a file to read; a usage error when it is missing or a folder."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{path} is a folder, not a file")
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    return path


def _analyze(args: argparse.Namespace, running: bool = True, backend: str | None = None) -> Analysis:
    path = _spec_path(args)
    try:
        return analyze(path, args.mesh, args.set, args.schedule, running, backend)
    except ValueError as exc:  # a malformed --mesh, --set or --schedule
        raise UsageError(str(exc)) from None


def _check(args: argparse.Namespace) -> int:
    from dslc.check.kernels import attention_kernels, describe

    result = _analyze(args, backend=args.backend)
    diags = result.diagnostics
    kernels = []
    if args.backend and result.ok and result.program is not None:
        kernels = attention_kernels(result.program, args.backend)
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
            if kernels:
                print(f"attention on {args.backend}:")
                for line in dict.fromkeys(describe(k) for k in kernels):
                    print(f"  {line}")
    return EXIT_ERRORS if any(d.severity is Severity.ERROR for d in diags) else EXIT_OK


def _summary(result: Analysis) -> str:
    from collections import Counter

    from dslc.ir.nodes import Block, counted, counted_layers, parameter_count

    program = result.program
    if program is None:
        return ""
    params = parameter_count(program)
    layers = sum(times for _, times in counted_layers(program.nodes))
    # The layers are every call in the model, activations included (a repeat's once per
    # copy); the blocks say how they group, which is how a model is usually counted ("a
    # two-layer transformer").
    blocks: Counter[str] = Counter()
    for node, times in counted(program.nodes):
        if isinstance(node, Block):
            blocks[node.block] += times
    grouped = ", ".join(f"{count} `{name}` block{'s' * (count != 1)}" for name, count in blocks.items())
    return (
        f" — model {program.name}, {layers} layer{'s' * (layers != 1)}{f' ({grouped})' if grouped else ''}, "
        f"{params:,} parameters, mesh {program.mesh.describe()}"
    )


def _fmt(args: argparse.Namespace) -> int:
    from dslc.syntax.format import format_module
    from dslc.syntax.parser import parse
    from dslc.syntax.source import read_path

    path = _existing_file(args.spec)
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


def _compile_to_python(args: argparse.Namespace) -> int:
    from dslc.codegen import MARKER, module_for
    from dslc.codegen.names import safe_identifier
    from dslc.codegen.source import RUNTIME

    result = _analyze(args)
    if not result.ok or result.program is None or result.source is None:
        sources = {result.source.name: result.source.text} if result.source else {}
        sys.stderr.write(render_text(result.diagnostics, sources))
        return EXIT_ERRORS
    program = result.program
    default = safe_identifier(Path(result.source.name).stem) + ".py"
    path = Path(args.output) if args.output else Path(default)
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give the module's file name, e.g. {path / default}")
    if path.exists() and not args.force and not _written_by_dslc(path, MARKER):
        raise UsageError(f"{path} exists and was not written by `dslc compile`; use --force to overwrite it")
    text = module_for(result, _regeneration_command(args, program.mesh.shape, path))
    _write_runtime(path.parent)
    write_atomic(path, text)
    print(
        f"{path}: model {program.name} on mesh {program.mesh.describe()}, {text.count(chr(10))} lines "
        f"(with the runtime library beside it, {path.parent / RUNTIME}/)"
    )
    return EXIT_OK


def _write_runtime(folder: Path) -> None:
    """The runtime library a generated module imports, written into `folder` as
    `dslc_runtime/` (each file atomically; one already as dslc would write it is left alone).
    A folder of that name that dslc did not write is refused."""
    from dslc.codegen.source import RUNTIME, runtime_files

    target = folder / RUNTIME
    files_now = runtime_files()
    if target.exists():
        init = target / "__init__.py"
        if not target.is_dir() or not init.is_file() or "The runtime library" not in init.read_text(errors="replace"):
            raise UsageError(
                f"{target} exists and is not dslc's runtime library; move it, or write the module elsewhere"
            )
    else:
        if not folder.is_dir():
            raise UsageError(f"no such folder: {folder}")
        target.mkdir()
    for name, text in files_now.items():
        path = target / name
        if not path.is_file() or path.read_text(errors="replace") != text:
            write_atomic(path, text)


def _regeneration_command(args: argparse.Namespace, mesh: tuple[int, ...], output: Path) -> tuple[str, str] | None:
    """The `dslc compile` command that writes this module again (the spec's path, mesh,
    settings and output as given) and the module's file name. None (the module then shows the
    spec's base name) when a path or setting holds characters a docstring would not show as
    typed."""
    words = ["dslc", "compile", *([args.spec] if args.spec else []), "--mesh", "x".join(map(str, mesh))]
    words += [part for setting in args.set or () for part in ("--set", setting)]
    words += ["--schedule", args.schedule] if args.schedule else []
    words += ["-o", str(output)] if args.output else []
    command = " ".join(shlex.quote(word) for word in [*words, "--force"])
    shown = f"{command} {output.name}"
    readable = shown.isprintable() and "\\" not in shown and '"""' not in shown
    return (command, shlex.quote(output.name)) if readable else None


def _written_by_dslc(path: Path, marker: str) -> bool:
    """Whether an existing file carries the generated-code marker near its top."""
    try:
        with path.open("rb") as f:
            head = f.read(16384)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    return marker.encode() in head


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
    from dslc.lower.devices import DeviceError, PlatformError

    path = _spec_path(args)
    try:
        return compile(path, args.mesh, args.set, args.schedule)
    except (ValueError, PlatformError) as exc:  # a malformed --mesh or --set; an accelerator not installed
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


def _load_npz(path_text: str) -> dict[str, Any]:
    path = _existing_file(path_text)
    try:
        return files.read_npz(path)
    except files.UnreadableArrays as exc:
        print(f"dslc: error: {exc}", file=sys.stderr)
        raise _Exit(EXIT_ERRORS) from None


def _save_npz(path_text: str, arrays: dict[str, Any]) -> None:
    """Write arrays as an .npz that plain numpy reads: bfloat16, which numpy has no type for
    (it would read such an array as raw `|V2` bytes), is widened to float32, exactly; dslc
    reads it back into bfloat16 weights unchanged."""
    import io

    import ml_dtypes
    import numpy as np

    readable: dict[str, Any] = {}
    for name, value in arrays.items():
        array = np.asarray(value)
        readable[name] = array.astype(np.float32) if array.dtype == ml_dtypes.bfloat16 else array
    buffer = io.BytesIO()
    np.savez(buffer, **readable)
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
    from dslc.interop import CheckpointError
    from dslc.layers.inputs import check_inputs, read_inputs
    from dslc.lower.program import WeightsError

    try:
        weights = _weights_given(args, program)
    except CheckpointError as exc:
        return _checkpoint_errors(_checked(args), exc)
    inputs = _load_npz(args.inputs)
    try:
        check_inputs(program.ir, inputs, read_inputs(program.ir, loss=args.grads))  # before any compilation
        model = program.load(weights)
        results = {"output": program.forward(model, inputs)}
        if args.grads:
            results["loss"] = program.loss(model, inputs)
            results.update({f"grad/{name}": g for name, g in program.grads(model, inputs).items()})
    except (WeightsError, ValueError) as exc:  # InputError is one too
        print(f"dslc: error: {exc}", file=sys.stderr)
        return EXIT_ERRORS
    import numpy as np

    _save_npz(args.output, {name: np.asarray(value) for name, value in results.items()})
    print(f"{args.output}: " + ", ".join(sorted(results)[:4]) + (", ..." if len(results) > 4 else ""))
    return EXIT_OK


def _checked(args: argparse.Namespace) -> Analysis:
    """The spec's analysis, or the exit that shows its errors."""
    result = _analyze(args)
    if not result.ok:
        sources = {result.source.name: result.source.text} if result.source else {}
        sys.stderr.write(render_text(result.diagnostics, sources))
        raise _Exit(EXIT_ERRORS)
    return result


def _checkpoint_errors(result: Analysis, exc: CheckpointError) -> int:
    sources = {result.source.name: result.source.text} if result.source else {}
    sys.stderr.write(render_text(exc.diagnostics, sources))
    return EXIT_ERRORS


def _import(args: argparse.Namespace) -> int:
    from dslc.interop import CheckpointError, import_checkpoint

    result = _checked(args)
    folder = Path(args.checkpoint)
    if not folder.is_dir():
        raise UsageError(f"no such folder: {folder}")
    try:
        done = import_checkpoint(result, folder, Path(args.output))
    except CheckpointError as exc:
        return _checkpoint_errors(result, exc)
    except files.FolderMissing as exc:
        raise UsageError(str(exc)) from None
    print(
        f"{args.output}: {done.weights} weights, {done.parameters:,} parameters "
        f"from {done.tensors} tensors of a {done.model_type} checkpoint"
    )
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from dslc.interop import CheckpointError, export_checkpoint

    result = _checked(args)
    try:
        weights = _weights_given(args)
        done = export_checkpoint(
            result, weights, Path(args.output), untie=args.untie, dtype=args.dtype, source=Path(args.weights)
        )
    except CheckpointError as exc:
        return _checkpoint_errors(result, exc)
    tied = ", the head tied to the embedding" if done.tied else ""
    print(f"{args.output}: a {done.model_type} checkpoint, {done.tensors} tensors ({done.bytes:,} bytes){tied}")
    return EXIT_OK


def _weights_given(args: argparse.Namespace, program: Any = None) -> dict[str, Any]:
    """--weights: a .npz, or a `dslc train` run folder (its newest checkpoint, restored onto
    `program`'s mesh, the spec compiled when not given). A folder that holds no run's
    checkpoint raises CheckpointError."""
    source = Path(args.weights)
    if not source.is_dir():
        return _load_npz(args.weights)
    from dslc.train.weights import trained_weights

    step, weights = trained_weights(program if program is not None else _compile(args), source)
    print(f"{source}: the parameters of checkpoint {step}", file=sys.stderr)
    return weights


def _plan(args: argparse.Namespace) -> int:
    import json

    from dslc.plan import plan

    if args.device_memory is not None and not args.device_memory > 0:
        raise UsageError(f"--device-memory must be a positive number of GiB, got {args.device_memory}")
    if args.mesh is not None and args.mesh.strip().lower() == "auto":
        if args.xla:
            raise UsageError("--xla compares the plan of one mesh; give --mesh AxBxC, not auto (or --measure K)")
        return _plan_auto(args)
    if args.devices is not None or args.measure is not None:
        raise UsageError(
            "--devices and --measure only apply with --mesh auto; a fixed --mesh says how many devices "
            "(and --xla measures it)"
        )
    hardware = _hardware(args)
    result = _analyze(args, running=False)
    if not result.ok:
        sources = {result.source.name: result.source.text} if result.source else {}
        sys.stderr.write(render_text(result.diagnostics, sources))
        return EXIT_ERRORS
    assert result.program is not None
    limit = None if args.device_memory is None else int(args.device_memory * (1 << 30))
    if args.xla:
        import jax

        from dslc.plan.report import Measured

        program = _compile(args)
        # Planned for the backend XLA compiles for here (on CPU, with what it alone holds).
        report = plan(result.program, limit, hardware, backend=jax.default_backend())
        report = replace(report, measured=Measured(*(program.compiled_memory(s).total for s in ("grads", "train"))))
    else:
        report = plan(result.program, limit, hardware)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        sys.stdout.write(report.to_text())
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    import json

    from dslc.plan.tensors import tensors

    result = _analyze(args)
    if not result.ok or result.program is None:
        sources = {result.source.name: result.source.text} if result.source else {}
        sys.stderr.write(render_text(result.diagnostics, sources))
        return EXIT_ERRORS
    shown = tensors(result.program)
    if args.format == "json":
        print(json.dumps(shown.to_json(), indent=2))
    else:
        sys.stdout.write(shown.to_text())
    return EXIT_OK


HARDWARE_FLAGS = ("device_flops", "intra_bandwidth", "inter_bandwidth", "node_size")
LATENCY_FLAGS = ("intra_latency", "inter_latency")


def _plan_auto(args: argparse.Namespace) -> int:
    import json

    from dslc.frontend import check_overrides, parse_overrides
    from dslc.plan.report import format_bytes
    from dslc.search.auto import AutoPlanner

    if args.devices is None or args.device_memory is None:
        raise UsageError("--mesh auto needs --devices N and --device-memory GiB (how many devices, how much each)")
    if args.schedule is not None and args.schedule.lower().endswith(".json"):
        raise UsageError(
            f"--schedule {args.schedule}: a table fixes its stages and microbatches, and --mesh auto chooses them; "
            "plan the table on its mesh with --mesh AxBxC"
        )
    if args.devices < 1:
        raise UsageError(f"--devices must be at least 1, got {args.devices}")
    hardware = _hardware(args)
    path = _spec_path(args)
    try:
        # The spec on its own mesh: its axes' roles, weights and FLOPs, whatever that mesh's errors.
        result = analyze(path, None, args.set, args.schedule, running=False)
        overrides = check_overrides(result.module, parse_overrides(args.set)) if result.module else {}
    except ValueError as exc:  # a malformed --set or --schedule
        raise UsageError(str(exc)) from None
    sources = {result.source.name: result.source.text} if result.source else {}
    if result.module is None or result.program is None:
        sys.stderr.write(render_text(result.diagnostics, sources))
        return EXIT_ERRORS
    planner = AutoPlanner(
        result.module,
        result.program,
        args.devices,
        int(args.device_memory * (1 << 30)),
        hardware,
        overrides,
        [args.schedule] if args.schedule else None,
    )
    found = planner.search()
    measured: tuple[str, list[Any]] | None = None
    if args.measure and result.source is not None:
        from dslc.lower.measure import measure

        measured = measure(found, result.source.text, result.module, overrides, args.measure)
    if args.format == "json":
        document = found.to_json()
        if measured is not None:
            backend, rows = measured
            document["measured"] = {
                "backend": backend,
                "candidates": [
                    {"rank": m.rank, "mesh": list(m.candidate.mesh), "planned": m.planned, "xla": m.xla} for m in rows
                ],
            }
        print(json.dumps(document, indent=2))
    else:
        sys.stdout.write(found.to_text())
        if measured is not None:
            from dslc.lower.measure import report

            sys.stdout.write(report(found, *measured))
    if found.chosen is not None:
        return EXIT_OK
    name = result.source.name if result.source else args.spec
    if found.closest is None:
        reason = next(
            (e.reason for e in found.excluded if e.memory is None),
            "none splits the batch evenly over its data axes with the schedules allowed",
        )
        print(f"dslc: error: {name}: no mesh of {args.devices} devices passes the checker: {reason}", file=sys.stderr)
        return EXIT_ERRORS
    mesh, size, exact = found.closest
    print(
        f"dslc: error: {name}: no plan on {args.devices} devices fits in {format_bytes(found.device_memory)} per "
        f"device; the closest plan found, on mesh {found.mesh_text(mesh)}, needs {'' if exact else 'at least '}"
        f"{format_bytes(size)}\n"
        "  = help: give more devices or more memory per device, or save memory in the spec "
        "(`zero`, `checkpoint`, bf16 `param_dtype`)",
        file=sys.stderr,
    )
    return EXIT_ERRORS


def _hardware(args: argparse.Namespace) -> Any:
    """The machine a plan's step time is estimated on: the cost model's defaults, or the flags'."""
    from dslc.plan.step_time import Hardware

    for name in HARDWARE_FLAGS:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in LATENCY_FLAGS:
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be zero or more, got {value}")
    default = Hardware()
    return Hardware(
        default.device_flops if args.device_flops is None else args.device_flops * 1e12,
        default.intra_bandwidth if args.intra_bandwidth is None else args.intra_bandwidth * 1e9,
        default.inter_bandwidth if args.inter_bandwidth is None else args.inter_bandwidth * 1e9,
        default.node_size if args.node_size is None else args.node_size,
        default.intra_latency if args.intra_latency is None else args.intra_latency * 1e-6,
        default.inter_latency if args.inter_latency is None else args.inter_latency * 1e-6,
        overlap=not args.no_overlap,
    )


def _profile_steps(text: str) -> tuple[int, int]:
    """--profile START:STOP (or one step) as (start, stop)."""
    from dslc.train.profile import parse_window

    try:
        return parse_window(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    """A whole number for --steps, --seed, --checkpoint-every, --num-processes and
    --process-id (0 only for --seed and --process-id)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


def _train(args: argparse.Namespace) -> int:
    if args.steps == 0 or args.checkpoint_every == 0 or args.eval_every == 0:
        raise UsageError("--steps, --checkpoint-every and --eval-every must be at least 1")
    if args.device_flops is not None and not args.device_flops > 0:
        raise UsageError(f"--device-flops must be a positive number of TFLOP/s, got {args.device_flops:g}")
    from dslc.train.distributed import DistributedError, cluster_from_flags, detect_cluster, joined

    if not args.no_overlap_flags:  # before jax starts, which reads them once
        from dslc.train.overlap import apply_overlap_flags

        backend, added = apply_overlap_flags(os.environ)
        if added:
            print(f"XLA: {len(added)} flags that overlap collectives with compute on {backend} (--no-overlap-flags)")
    try:
        flags = cluster_from_flags(args.coordinator, args.num_processes, args.process_id)
        cluster = flags or detect_cluster(os.environ)
        if cluster is None:
            return _train_here(args)
        # The processes join before jax starts, each with its share of the mesh's devices,
        # so the spec is read first; one with errors joins nothing, _compile reports them.
        analysis = _analyze(args)
        if analysis.program is None or not analysis.ok:
            return _train_here(args)
        with joined(cluster, analysis.program.mesh.devices):
            return _train_here(args)
    except DistributedError as exc:
        raise UsageError(str(exc)) from None


def _train_here(args: argparse.Namespace) -> int:
    initial = _initial_weights(args) if args.init_from else None
    program = _compile(args)  # first: it decides how many host devices jax starts with
    from dslc.train.dashboards import DashboardError, wandb_missing
    from dslc.train.dataset import DataError

    if args.wandb and wandb_missing():  # before the run folder is made
        raise UsageError(wandb_missing())
    from dslc.train.loop import TrainError, TrainInterrupted, TrainOptions, has_checkpoints, train

    out = Path(args.out) if args.out else _run_folder(program.ir.name, args)
    data = Path(args.data) if args.data is not None else None
    resume = args.resume or (args.auto_resume and has_checkpoints(out))
    options = TrainOptions(
        args.steps,
        out,
        args.seed,
        args.checkpoint_every,
        resume,
        data,
        args.eval_every,
        initial,
        args.document_end,
        async_checkpoints=not args.sync_checkpoints,
        device_flops=args.device_flops,
        profile=args.profile,
        wandb=args.wandb,
    )
    try:
        result = train(program, options)
    except (DataError, TrainError, DashboardError) as exc:
        raise UsageError(str(exc)) from None
    except TrainInterrupted as stopped:
        print(f"stopped at step {stopped.step}, checkpoint saved; to continue:\n  {_resume_command(args, out)}")
        return 128 + stopped.signal  # as a shell reports a process stopped by the signal: 130 Ctrl-C, 143 SIGTERM
    if result.leader:
        print(result.summary())
    return EXIT_OK


def _resume_command(args: argparse.Namespace, out: Path) -> str:
    """The `dslc train` command line that continues a run in `out`."""
    import shlex

    words = ["dslc", "train"] + ([args.spec] if args.spec else [])
    for flag, value in (
        ("--mesh", args.mesh),
        ("--schedule", args.schedule),
        ("--data", args.data),
        ("--document-end", args.document_end),
        ("--eval-every", args.eval_every),
        ("--checkpoint-every", args.checkpoint_every),
        ("--device-flops", args.device_flops),
        ("--coordinator", args.coordinator),
        ("--num-processes", args.num_processes),
        ("--process-id", args.process_id),
    ):
        if value is not None:
            words += [flag, str(value)]
    words += ["--sync-checkpoints"] if args.sync_checkpoints else []
    words += ["--no-overlap-flags"] if args.no_overlap_flags else []
    for pair in args.set:
        words += ["--set", pair]
    words += ["--steps", str(args.steps), "--out", str(out), "--auto-resume" if args.auto_resume else "--resume"]
    return shlex.join(words)


def _initial_weights(args: argparse.Namespace) -> dict[str, Any]:
    """--init-from's weights, read before jax starts (a checkpoint folder as `dslc import` reads it)."""
    from dslc.interop import CheckpointError
    from dslc.train.weights import initial_weights

    if args.resume:
        raise UsageError("--init-from starts a new run from given weights; --resume continues one from its checkpoint")
    source = Path(args.init_from)
    if not source.exists():
        raise UsageError(f"no such file or folder: {source}")
    result = _checked(args)
    try:
        return initial_weights(source, result)
    except CheckpointError as exc:
        raise _Exit(_checkpoint_errors(result, exc)) from None
    except (OSError, ValueError) as exc:
        print(
            f"dslc: error: cannot read weights from {source}: {exc}\n"
            "  = help: --init-from takes a .npz (as `dslc init` and `dslc import` write) or a Hugging Face "
            "checkpoint folder (config.json and .safetensors files)",
            file=sys.stderr,
        )
        raise _Exit(EXIT_ERRORS) from None


def _run_folder(model: str, args: argparse.Namespace) -> Path:
    """The default run folder: `runs/MODEL`, or for a fresh run when that already holds
    one, the next free `runs/MODEL-2`, `-3`, ... (so running the same command twice never
    clashes with, or touches, an earlier run); `--resume` continues the newest of them.
    Processes of one multi-process run must agree on it, so they always use `runs/MODEL`."""
    base = Path("runs") / model
    if args.auto_resume:  # the same folder at every restart
        return base
    if args.coordinator is not None or os.environ.get("SLURM_NTASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return base
    folders = [base] + [base.with_name(f"{model}-{i}") for i in range(2, 10_000)]
    existing = [f for f in folders if f.exists()]
    if args.resume:
        return existing[-1] if existing else base
    return next(f for f in folders if not f.exists())


def _schedule(args: argparse.Namespace) -> int:
    import json

    from dslc.schedules import ScheduleError, build
    from dslc.schedules.render import tick_legend, to_json, to_svg, to_text

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
            sys.stdout.write(to_text(schedule) + tick_legend(schedule) + "\n")
    return EXIT_OK


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
