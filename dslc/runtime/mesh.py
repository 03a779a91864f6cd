"""Meshes that span nodes: which device sits where, when some axes cross the slow network.

A cluster's devices talk fast inside a node (NVLink inside a GPU host, ICI inside a TPU
slice) and slowly between nodes (InfiniBand or Ethernet, DCN between slices). A mesh axis
declared `across N nodes` is cut into N equal parts, one per node, the part's devices
inside that node; every other axis stays inside each node. So axis i of size s_i spanning
n_i nodes is laid out as n_i blocks (the slow, outer part) of s_i / n_i devices each (the
fast, inner part), the same layout as jax's `create_hybrid_device_mesh` with
`dcn_mesh_shape` n and `mesh_shape` s / n.

Which devices form a node: a TPU slice (the devices' `slice_index`) when there are that many
slices; otherwise the processes in order, each node taking the same number of whole
processes (one process per GPU host, or one per GPU); and within a single process that
simulates several nodes (CPU devices in tests), consecutive devices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


class NodeLayoutError(ValueError):
    """The devices cannot be divided into the nodes the mesh asks for."""


class TooFewDevices(ValueError):
    """This process has fewer devices than the mesh needs, even simulated on CPU."""


def machine_mesh(shape: Sequence[int], names: Sequence[str], nodes: Sequence[int]) -> Any:
    """The mesh on this machine's devices, or on simulated CPU devices when there are too few
    (a script's fallback: `dslc` itself refuses, saying why, in `dslc.lower.devices`)."""
    import jax

    count = math.prod(shape)
    devices = jax.devices()
    if len(devices) < count:
        devices = jax.devices("cpu")
    if len(devices) < count:
        raise TooFewDevices(f"the mesh needs {count} devices and this process has {len(devices)}")
    return build_mesh(shape, names, nodes, devices[:count])


def build_mesh(shape: Sequence[int], names: Sequence[str], nodes: Sequence[int], devices: Sequence[Any]) -> Any:
    """The `jax.sharding.Mesh` of `shape` over `devices` (as many as it needs), axes `Auto`:
    jax's own layout when no axis crosses nodes, else the node layout (`node_layout`)."""
    import jax

    auto = (jax.sharding.AxisType.Auto,) * len(names)
    if math.prod(nodes) == 1:
        return jax.make_mesh(tuple(shape), tuple(names), axis_types=auto, devices=devices)
    return jax.sharding.Mesh(node_layout(shape, nodes, devices), tuple(names), axis_types=auto)


def node_layout(shape: Sequence[int], nodes: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """The devices of a mesh of `shape` whose axis i spans `nodes[i]` nodes, as an array of
    that shape (for `jax.sharding.Mesh`)."""
    from jax.experimental import mesh_utils

    count = math.prod(nodes)
    inside = tuple(size // n for size, n in zip(shape, nodes, strict=True))
    per_node = [
        mesh_utils.create_device_mesh(inside, group, allow_split_physical_axes=True)
        for group in _node_groups(devices, count)
    ]
    # One block per node, placed in the grid of nodes: axis i's index is then the node's
    # coordinate along it times the block's extent plus the position inside the block.
    grid = np.empty(tuple(nodes), dtype=object)
    for index, block in zip(np.ndindex(*nodes), per_node, strict=True):
        grid[index] = block
    return np.block(grid.tolist())


def _node_groups(devices: Sequence[Any], count: int) -> list[list[Any]]:
    """The devices split into `count` nodes (see the module's docstring)."""
    if len(devices) % count:
        raise NodeLayoutError(f"{len(devices)} devices do not split into {count} nodes of equal size")
    slices = {getattr(d, "slice_index", None) for d in devices}
    processes = len({d.process_index for d in devices})
    if len(slices) != count and processes > 1 and processes % count:
        raise NodeLayoutError(
            f"the mesh spans {count} nodes, and the run's {processes} processes do not split evenly among them"
        )
    ordered = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.process_index, d.id))
    size = len(devices) // count
    return [ordered[i * size : (i + 1) * size] for i in range(count)]
