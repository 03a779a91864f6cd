"""How long `dslc check` takes on a deep model, and what the front end imports.

    .venv/bin/python bench/bench_check.py [--runs N] [--profile]

Builds a 96-layer GPT from specs/gpt_small.par (4 pipeline stages of 24 blocks, 16
microbatches, on a 2x4x4 data x model x stage mesh), then prints: the time of the first
`dslc.check` in this process (grammar compilation included) and the median of the next N,
the time `dslc plan` takes on specs/gpt3_175b.par, the import time of `dslc` in fresh
interpreters, and whether the front end imported jax (it must not). `--profile` adds the top
of a cProfile of one warm check.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 0.3

_EDITS = (
    (r"(?m)^const n_layers = \d+", "const n_layers = 96"),
    (r"(?m)^const batch = \d+", "const batch = 64"),
    (r"(?m)^(mesh .*)stage=\d+", r"\1stage=4"),
    (r"(?m)^(\s*)microbatches \d+", r"\1microbatches 16"),
)


def deep_spec() -> str:
    text = (ROOT / "specs" / "gpt_small.par").read_text(encoding="utf-8")
    for pattern, replacement in _EDITS:
        text, n = re.subn(pattern, replacement, text)
        if n != 1:
            raise SystemExit(f"specs/gpt_small.par changed: `{pattern}` matched {n} times; update bench/bench_check.py")
    return text


def fresh_import_seconds(runs: int) -> list[float]:
    probe = "import time; t = time.perf_counter(); import dslc; print(time.perf_counter() - t)"
    command = [sys.executable, "-c", probe]
    return [
        float(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout) for _ in range(runs)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="warm runs to take the median of")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one warm check")
    args = parser.parse_args()

    started = time.perf_counter()
    import dslc
    from dslc.ir.nodes import all_layers

    import_in_process = time.perf_counter() - started
    text = deep_spec()

    t = time.perf_counter()
    diags = dslc.check(text)
    first = time.perf_counter() - t
    if diags:
        for d in diags:
            print(f"  {d.span.line}:{d.span.column} {d.severity}[{d.code}] {d.message}")
        raise SystemExit("the benchmark spec should check clean")
    warm = []
    for _ in range(args.runs):
        t = time.perf_counter()
        dslc.check(text)
        warm.append(time.perf_counter() - t)
    analysis = dslc.analyze(text)
    assert analysis.program is not None
    layers = len(all_layers(analysis.program))
    jax_loaded = "jax" in sys.modules
    imports = fresh_import_seconds(5)
    from dslc.plan import plan

    gpt3 = dslc.analyze(ROOT / "specs" / "gpt3_175b.par").program
    assert gpt3 is not None
    t = time.perf_counter()
    plan(gpt3)
    planned = time.perf_counter() - t

    median = statistics.median(warm)
    print(f"spec: gpt_small with 96 blocks ({layers} layers), mesh {analysis.program.mesh.describe()}")
    print(f"dslc.check, first run in process:   {first * 1000:8.1f} ms  (includes compiling the grammar)")
    spread = f"min {min(warm) * 1000:.1f}, max {max(warm) * 1000:.1f}"
    print(f"dslc.check, median of {args.runs:3d} runs:    {median * 1000:8.1f} ms  ({spread})")
    print(f"import dslc, this process:           {import_in_process * 1000:8.1f} ms")
    print(f"import dslc, fresh process (median): {statistics.median(imports) * 1000:8.1f} ms  (of {len(imports)})")
    print(f"dslc plan of gpt3_175b (96 layers):  {planned * 1000:8.1f} ms")
    print(f"jax imported by the front end:       {'YES (a bug)' if jax_loaded else 'no'}")
    verdict = "within" if median <= BUDGET_S else "OVER"
    print(f"budget {BUDGET_S * 1000:.0f} ms for a warm check: {verdict}")

    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(dslc.check, text)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return 1 if jax_loaded else 0


if __name__ == "__main__":
    sys.exit(main())
