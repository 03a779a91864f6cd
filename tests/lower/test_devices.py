"""The mesh's devices: simulated CPU devices when jax has not started, a clear error otherwise.

The first two tests run in fresh interpreters without XLA_FLAGS (this test process fixed its
device count at collection time).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from dslc.ir.nodes import Mesh, MeshAxis
from dslc.lower.devices import _shortfall
from tests.conftest import ROOT, SPECS


def fresh_python(script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", script, str(SPECS / "tiny.par")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def test_compile_after_importing_jax_still_gets_its_simulated_devices() -> None:
    # Importing jax does not start its backends, so the device count can still be set.
    done = fresh_python("import sys, jax, dslc\nprogram = dslc.compile(sys.argv[1])\nprint(len(jax.devices()))")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 4  # tiny's 2x2 mesh


@pytest.mark.parametrize(
    ("before", "have"),
    [
        ("jax.devices()", "1 CPU device"),
        # A count set in jax is someone's choice (a multi-process run sets each process's share).
        ("jax.config.update('jax_num_cpu_devices', 2)", "2 CPU devices"),
    ],
)
def test_compile_after_jax_started_or_was_set_says_why_it_cannot_have_more_devices(before: str, have: str) -> None:
    script = (
        f"import sys, jax, dslc\nfrom dslc.lower.devices import DeviceError\n{before}\n"
        "try:\n    dslc.compile(sys.argv[1])\nexcept DeviceError as exc:\n    print(exc)"
    )
    done = fresh_python(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"the mesh 2x2 (data, model) needs 4 devices, but jax has {have}: it had started")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4 before starting Python" in done.stdout


@dataclass
class FakeDevice:
    platform: str


def test_too_few_accelerators_is_an_error_about_them_not_cpu_flags() -> None:
    mesh = Mesh((MeshAxis("data", 2), MeshAxis("model", 4)))
    message = _shortfall(mesh, [FakeDevice("gpu"), FakeDevice("gpu")])  # type: ignore[list-item]
    assert message.startswith("the mesh 2x4 (data, model) needs 8 devices, but this process sees 2 GPU devices")
    assert "a --mesh of at most 2 devices" in message and "JAX_PLATFORMS=cpu" in message
    assert "XLA_FLAGS" not in message


def test_the_readme_quotes_the_shortfall_error_as_it_is() -> None:
    mesh = Mesh((MeshAxis("data", 2), MeshAxis("model", 4)))
    message = _shortfall(mesh, [FakeDevice("gpu"), FakeDevice("gpu")])  # type: ignore[list-item]
    assert f"dslc: error: {message}\n" in (ROOT / "README.md").read_text()
