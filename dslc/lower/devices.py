"""Devices and the mesh: simulate a mesh on CPU host devices when there are too few.

XLA decides how many CPU devices exist when jax starts its backend, so the request has to
be made before then. A process that needs N devices and has not started jax yet gets
`--xla_force_host_platform_device_count` raised to N; one that already started with too
few gets a clear error saying what to do.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

from dslc.ir.nodes import Mesh

if TYPE_CHECKING:
    import jax

_FLAG = "--xla_force_host_platform_device_count"


class DeviceError(RuntimeError):
    """The process cannot provide the devices the mesh needs."""


def request_host_devices(n: int) -> None:
    """Ask for at least `n` CPU devices, if jax has not started yet (a no-op otherwise)."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    found = re.search(rf"{_FLAG}=(\d+)", flags)
    if found and int(found.group(1)) >= n:
        return
    flags = re.sub(rf"\s*{_FLAG}=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def make_mesh(mesh: Mesh) -> jax.sharding.Mesh:
    """The jax mesh for the IR's mesh, on the first `mesh.devices` devices.

    Axes are `Auto`: shardings are declared on parameters and constrained on activations,
    and XLA's partitioner inserts the collectives. Explicit axes would need an
    `out_sharding` on every contraction and all-gather tensor-parallel weights at a
    partial-manual `shard_map` boundary (see the project's field notes).
    """
    request_host_devices(mesh.devices)
    import jax

    devices = jax.devices()
    if len(devices) < mesh.devices:
        raise DeviceError(
            f"the mesh {mesh.describe()} needs {mesh.devices} devices, but this process has "
            f"{len(devices)} ({devices[0].platform}); on CPU, set "
            f"XLA_FLAGS={_FLAG}={mesh.devices} before jax is first imported"
        )
    names = mesh.names or ("replica",)
    shape = mesh.shape or (1,)
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=auto, devices=devices[: mesh.devices])
