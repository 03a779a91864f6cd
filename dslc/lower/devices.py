"""Devices and the mesh: simulate a mesh on CPU host devices when there are too few.

XLA decides how many CPU devices exist when jax starts its backends (on first use, not on
import), so the request has to be made before then: a process that has not imported jax
gets `--xla_force_host_platform_device_count` raised in its environment, one that has
imported it but not used it yet gets jax's `jax_num_cpu_devices` setting raised. A process
whose backends already started with too few, or a machine with fewer accelerators than the
mesh needs, gets an error that says which.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TYPE_CHECKING

from dslc.ir.nodes import Mesh
from dslc.runtime.mesh import NodeLayoutError, build_mesh

if TYPE_CHECKING:
    import jax

_FLAG = "--xla_force_host_platform_device_count"


class DeviceError(RuntimeError):
    """The process cannot provide the devices the mesh needs."""


def request_host_devices(n: int) -> None:
    """Ask for at least `n` CPU devices, if jax has not started its backends yet (a no-op
    otherwise: `make_mesh` then reports a shortfall)."""
    if "jax" in sys.modules:
        import jax

        # A count already set in jax is someone's choice (a multi-process run sets each
        # process's share of the mesh): left alone. (jax's Config declares no attribute per
        # option: it makes them at run time, so the type checker cannot see this one.)
        if jax.config.jax_num_cpu_devices < 0 and _flag_count() < n:  # type: ignore[attr-defined]
            with contextlib.suppress(RuntimeError):  # the backends have started: too late to change
                jax.config.update("jax_num_cpu_devices", n)
        return
    if _flag_count() >= n:
        return
    flags = re.sub(rf"\s*{_FLAG}=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def _flag_count() -> int:
    """How many CPU devices the XLA flag asks for (1 without it)."""
    found = re.search(rf"{_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


def make_mesh(mesh: Mesh) -> jax.sharding.Mesh:
    """The jax mesh for the IR's mesh, on the first `mesh.devices` devices.

    Axes are `Auto`: shardings are declared on parameters and constrained on activations,
    and XLA's partitioner inserts the collectives. Explicit axes would need an
    `out_sharding` on every contraction and all-gather tensor-parallel weights at a
    partial-manual `shard_map` boundary (see the project's field notes).
    """
    request_host_devices(mesh.devices)
    devices = _devices()
    if len(devices) < mesh.devices:
        raise DeviceError(_shortfall(mesh, devices))
    names = mesh.names or ("replica",)
    shape = mesh.shape or (1,)
    nodes = tuple(a.nodes for a in mesh.axes) or (1,)
    try:
        mesh_of_devices: jax.sharding.Mesh = build_mesh(shape, names, nodes, devices[: mesh.devices])
    except NodeLayoutError as exc:
        raise DeviceError(f"mesh {mesh.describe()}: {exc}") from None
    return mesh_of_devices


class PlatformError(DeviceError):
    """jax cannot start the platform the environment asks for (`JAX_PLATFORMS`): a usage
    problem of the installation, not of the spec."""


def _devices() -> list[jax.Device]:
    """jax's devices; a platform it cannot start is a PlatformError that says what to install."""
    import jax

    try:
        return jax.devices()
    except (RuntimeError, AssertionError) as exc:  # jax 0.10 asserts when a named platform has no plugin
        asked = os.environ.get("JAX_PLATFORMS", "")
        detail = str(exc).split(" (set JAX_PLATFORMS")[0].strip() or "no such backend is installed"
        raise PlatformError(
            f"jax cannot start the platform JAX_PLATFORMS={asked!r} asks for ({detail}); for NVIDIA GPUs install "
            "jax's CUDA wheels with `pip install -e '.[cuda]'`, for TPUs `pip install -e '.[tpu]'`; or unset "
            "JAX_PLATFORMS (JAX_PLATFORMS=cpu simulates the mesh on this machine's CPU)"
        ) from None


def _shortfall(mesh: Mesh, devices: list[jax.Device]) -> str:
    have = f"{len(devices)} {devices[0].platform.upper()} device{'s' * (len(devices) != 1)}"
    need = f"the mesh {mesh.describe()} needs {mesh.devices} devices"
    if devices[0].platform == "cpu":
        return (
            f"{need}, but jax has {have}: it had started, or its jax_num_cpu_devices was set, before dslc "
            f"could ask for more; compile the spec before anything in this process uses jax (importing it is "
            f"fine), or set XLA_FLAGS={_FLAG}={mesh.devices} before starting Python"
        )
    return (
        f"{need}, but this process sees {have}: run on more (a multi-process run adds each process's), "
        f"or choose a --mesh of at most {len(devices)} devices; JAX_PLATFORMS=cpu simulates the mesh on CPU "
        "devices instead"
    )
