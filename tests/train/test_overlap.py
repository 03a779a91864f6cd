"""The XLA flags that overlap collectives with compute: which backend gets which, what a user
set is kept, and every GPU flag is one this jaxlib's XLA knows (it aborts on any other)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dslc.train.overlap import PROFILES, apply_overlap_flags, coming_backend


@pytest.mark.parametrize(
    ("platforms", "backend"), [("cuda", "gpu"), ("tpu", "tpu"), ("cpu", "cpu"), ("cuda,cpu", "gpu")]
)
def test_the_backend_is_known_before_jax_starts(platforms: str, backend: str) -> None:
    assert coming_backend({"JAX_PLATFORMS": platforms}) == backend


def test_a_flag_the_user_set_is_kept_and_the_others_added() -> None:
    mine = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false"
    environ = {"XLA_FLAGS": mine}
    backend, added = apply_overlap_flags(environ, "gpu")
    assert backend == "gpu"
    assert [f.name for f in added] == [f.name for f in PROFILES["gpu"][1:]]
    assert environ["XLA_FLAGS"].startswith(mine)
    assert environ["XLA_FLAGS"].count("latency_hiding_scheduler") == 1
    # Applied twice, nothing is added twice.
    assert apply_overlap_flags(environ, "gpu")[1] == []


def test_tpu_flags_go_to_libtpu_and_cpu_gets_none() -> None:
    environ: dict[str, str] = {}
    apply_overlap_flags(environ, "tpu")
    assert set(environ) == {"LIBTPU_INIT_ARGS"}
    assert all(f"--{flag.name}=" in environ["LIBTPU_INIT_ARGS"] for flag in PROFILES["tpu"])
    untouched: dict[str, str] = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert apply_overlap_flags(untouched, "cpu") == ("cpu", [])
    assert untouched == {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def test_every_gpu_flag_is_one_xla_knows() -> None:
    # XLA parses every backend's flags from XLA_FLAGS when it starts, on any backend, and
    # stops the process at a name it does not know (checked: a made-up one exits non-zero).
    flags = " ".join(f"--{flag.name}={flag.value}" for flag in PROFILES["gpu"])
    script = "import jax; jax.devices()"
    for extra, ok in (("", True), (" --xla_no_such_flag_here=1", False)):
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={"XLA_FLAGS": flags + extra, "JAX_PLATFORMS": "cpu", "PATH": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode == 0) == ok, done.stderr[-500:]
