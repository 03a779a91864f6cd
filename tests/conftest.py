"""Shared test set-up.

The simulated device count must be fixed before jax is imported anywhere in the test
process, so it is set here, at collection time.

`compiled(...)` is a session-wide cache of compiled programs and what they computed: the
numerics, codegen, pipeline and lowering tests that look at one spec on one mesh share one
compilation of it.

Below it, JAX's persistent compilation cache, in a folder of this run's own, shares every
compiled XLA program across tests, across the test processes (`pytest -n`), and across the
`dslc` processes tests start: many tests train or run the same spec on the same mesh through
the CLI, and each would otherwise compile it again. Measured: tests/train/test_train.py 210 s
without, 112 s with. The folder is in pytest's temporary root for this run (shared by its
worker processes, removed with pytest's old runs), so no run reads another's programs. A
pipelined program's steps stay out of it (`dslc.lower.program.outside_persistent_cache`:
XLA:CPU loads them with some collectives unordered; README, known problems).

Families of cases too slow to run whole in the suite (`@pytest.mark.sample(k)` on a
parametrized test) run k of their cases, drawn anew each day (`sample_seed`); `--every-case`
runs them all, as does naming the test (`pytest FILE::TEST`).
"""

from __future__ import annotations

import datetime
import functools
import os
import random
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Tests check what programs compute and how XLA partitions and places them, not how fast the
# machine code runs: XLA's CPU code generator runs at its lowest optimization level, which
# compiles about 40% faster (tests/lower/test_lowering.py's ZeRO fixture: 94-105 s -> 59-62 s)
# and leaves the optimized HLO and XLA's memory analysis byte for byte as they are (checked on
# gpt_small's and llama_small's training steps). Only the last bit of a float may differ from a
# program compiled at the default level (multiply-adds contracted differently), so processes
# that tests start compile at this level too (`own_mesh_env`). Benchmarks use the default.
# XLA's CPU collectives give up (and abort the process) after 40 s of waiting for the other
# devices, which two test processes on two cores, each simulating 16 devices, can reach with
# no bug at all; a collective that truly never completes is found before it runs by the
# layout harness (`dslc.lower.hlo.stalling`), and otherwise still ends the run, later.
PATIENCE = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
CODEGEN_LEVEL = f"--xla_backend_optimization_level=0 {PATIENCE}"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=16 {CODEGEN_LEVEL}")


def own_mesh_env() -> dict[str, str]:
    """The environment for a process that simulates its own mesh (no device count set), at
    the tests' code-generation level and patience."""
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": CODEGEN_LEVEL}


ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
TEST_SPECS = ROOT / "tests" / "specs"  # the specs only tests use

if TYPE_CHECKING:
    import numpy as np

    from dslc.lower.program import DslcModel, Program


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true", help="rewrite golden files from current output")
    parser.addoption(
        "--layouts",
        default="sample",
        help="tests/lower/test_layouts.py: `sample` (the suite's seeded sample), `all`, or combination ids",
    )
    parser.addoption(
        "--every-case", action="store_true", help="run every case of the families the suite samples (`sample` marker)"
    )


def sample_seed() -> int:
    """The seed of the suite's samples: the day's, unless DSLC_SAMPLE_SEED repeats a draw."""
    return int(os.environ.get("DSLC_SAMPLE_SEED", datetime.date.today().toordinal()))


def pytest_report_header(config: pytest.Config) -> str:
    return f"sample seed: {sample_seed()} (DSLC_SAMPLE_SEED=N repeats a draw; --every-case runs every case)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Of each family marked `sample(k)`, keep k cases drawn with the day's seed. Every
    process draws the same (xdist needs each worker to collect the same tests)."""
    if config.getoption("--every-case"):
        return
    named = {arg.split("[")[0] for arg in config.args if "::" in arg}
    families: dict[tuple[str, str], list[pytest.Item]] = defaultdict(list)
    for item in items:
        marker = item.get_closest_marker("sample")
        function = item.nodeid.split("[")[0]
        if marker is not None and function not in named and not any(function.endswith(n) for n in named):
            families[(function, str(marker.args[0]))].append(item)
    dropped: set[str] = set()
    for (function, count), members in families.items():
        # Tests of one `group` over the same cases draw the same ones (a module's fixture per
        # case is then made for only those).
        marker = members[0].get_closest_marker("sample")
        assert marker is not None
        key = f"{function.split('::')[0]}::{marker.kwargs['group']}" if "group" in marker.kwargs else function
        draw = random.Random(f"{sample_seed()}:{key}")
        kept = set(draw.sample(range(len(members)), min(int(count), len(members))))
        dropped |= {m.nodeid for i, m in enumerate(members) if i not in kept}
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in dropped])
        items[:] = [i for i in items if i.nodeid not in dropped]


@pytest.fixture(scope="session", autouse=True)
def _shared_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Before the first test compiles anything: this process's jax, and through the
    environment every process a test starts, use one compilation cache for the whole run."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's own folder sits in the run's shared root
    folder = root / "xla-cache"
    folder.mkdir(exist_ok=True)
    settings = {
        "jax_compilation_cache_dir": str(folder),
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    import jax

    for name, value in settings.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@dataclass
class Compiled:
    """A spec compiled on a mesh, its weights from seed 0 and a batch from seed 0; what it
    computes on them is evaluated once, when first asked for."""

    program: Program
    model: DslcModel
    batch: dict[str, np.ndarray]

    @functools.cached_property
    def weights(self) -> dict[str, np.ndarray]:
        return self.program.export_weights(self.model)

    @functools.cached_property
    def output(self) -> np.ndarray:
        import numpy as np

        return np.asarray(self.program.forward(self.model, self.batch))

    @functools.cached_property
    def loss_and_grads(self) -> tuple[float, dict[str, np.ndarray]]:
        return self.program.loss_and_grads(self.model, self.batch)

    @property
    def loss(self) -> float:
        return self.loss_and_grads[0]

    @property
    def grads(self) -> dict[str, np.ndarray]:
        return self.loss_and_grads[1]


@functools.cache
def _compile(source: str, mesh: str | None, overrides: tuple[tuple[str, Any], ...], schedule: str | None) -> Compiled:
    import dslc

    path = Path(source)
    program = dslc.compile(path if path.suffix == ".par" and path.exists() else source, mesh, dict(overrides), schedule)
    return Compiled(program, program.init(0), program.example_batch(0))


def compiled(
    source: str | Path,
    mesh: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    schedule: str | None = None,
) -> Compiled:
    """The spec (a path or its text) compiled on `mesh`, shared by every test that asks."""
    return _compile(str(source), mesh, tuple(sorted((overrides or {}).items())), schedule)
