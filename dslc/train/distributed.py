"""Training in several processes: JAX's multi-process runtime, joined before jax starts.

N processes form one global mesh, each holding an equal share of its devices (on a CPU-only
machine, `devices / N` simulated host devices each); the jitted train step is the same
program in every process, and XLA runs its collectives across processes (through gloo
between CPU processes). The processes learn of each other from flags (`--coordinator
HOST:PORT --num-processes N --process-id I`) or, without flags, from the environment of a
launcher JAX itself recognises: an Open MPI `mpirun` or a Slurm job step (`srun`) of more
than one process. With neither, nothing is initialised and the run is an ordinary
single-process one.

Nothing here imports jax at module level: the CLI reads the flags before jax may start.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from dslc.lower.program import Program


class DistributedError(Exception):
    """Flags or a launcher environment that do not describe a usable multi-process run."""


@dataclass(frozen=True)
class Cluster:
    """One process's place in a multi-process run."""

    num_processes: int
    process_id: int
    coordinator: str | None  # HOST:PORT of process 0; None: the launcher's environment says
    launcher: str | None  # jax's cluster detection method ("ompi", "slurm"); None with flags

    def describe(self) -> str:
        how = f"coordinator {self.coordinator}" if self.coordinator else f"launched by {self.launcher}"
        return f"process {self.process_id} of {self.num_processes} ({how})"


# The launchers jax 0.10.2 detects without asking the network or an optional package, in the
# order it tries them, each with the variables whose presence it checks (see
# jax/_src/clusters/{ompi,slurm}_cluster.py) and those holding the process count and id.
_LAUNCHERS = (
    ("ompi", ("OMPI_MCA_orte_hnp_uri",), "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_LOCALID"), "SLURM_NTASKS", "SLURM_PROCID"),
)


def cluster_from_flags(coordinator: str | None, num_processes: int | None, process_id: int | None) -> Cluster | None:
    """The run the three flags describe (None when none is given); DistributedError says
    what is wrong with them."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    missing = [flag for flag, value in given.items() if value is None]
    if len(missing) == len(given):
        return None
    if missing:
        raise DistributedError(
            f"{' and '.join(missing)} missing: a multi-process run needs --coordinator HOST:PORT, "
            "--num-processes N and --process-id I together"
        )
    assert coordinator is not None and num_processes is not None and process_id is not None
    host, colon, port = coordinator.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"--coordinator must be HOST:PORT, the address of process 0 (e.g. 127.0.0.1:7000), not {coordinator!r}"
        )
    if num_processes < 1:
        raise DistributedError("--num-processes must be at least 1")
    if process_id >= num_processes:
        raise DistributedError(
            f"--process-id must be below --num-processes: the processes are 0 to {num_processes - 1}, not {process_id}"
        )
    return Cluster(num_processes, process_id, coordinator, launcher=None)


def detect_cluster(environ: Mapping[str, str]) -> Cluster | None:
    """The multi-process launch that jax's own detection finds in `environ`, or None where
    there is none or it started a single process."""
    for launcher, markers, size, rank in _LAUNCHERS:
        if not all(name in environ for name in (*markers, size, rank)):
            continue
        if not (environ[size].isdigit() and environ[rank].isdigit()):
            raise DistributedError(f"{launcher} set {size}={environ[size]!r} and {rank}={environ[rank]!r}: not counts")
        num_processes, process_id = int(environ[size]), int(environ[rank])
        if num_processes <= 1:
            return None
        return Cluster(num_processes, process_id, coordinator=None, launcher=launcher)
    return None


@contextmanager
def joined(cluster: Cluster | None, devices: int) -> Iterator[None]:
    """Inside, this process is part of `cluster` (nothing changes for None), for a mesh of
    `devices` devices in all. Must be entered before jax starts its backends."""
    if cluster is None:
        yield
        return
    if devices % cluster.num_processes:
        raise DistributedError(
            f"the mesh has {devices} devices, which do not split evenly over {cluster.num_processes} processes"
        )
    if cluster.coordinator is not None and cluster.process_id == 0:
        _check_port_free(cluster.coordinator)
    import jax

    # Both settings only concern the CPU backend, so they are harmless where the mesh is
    # on accelerators. The device count overrides XLA_FLAGS' forced count, which would
    # give every process the whole mesh's worth.
    jax.config.update("jax_num_cpu_devices", devices // cluster.num_processes)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            cluster.coordinator,
            cluster.num_processes,
            cluster.process_id,
            cluster_detection_method=cluster.launcher,
        )
    # What jax raises: a launcher environment it cannot read, a second initialisation. A
    # coordinator that never answers is not among them: after jax's initialization timeout
    # (300 s) jaxlib aborts the process.
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(f"{cluster.describe()} could not join the run: {exc}") from None
    try:
        with _native_output_to_stderr():
            yield
    finally:
        jax.distributed.shutdown()


@contextmanager
def _native_output_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr, and Python's `sys.stdout` at a duplicate of the
    real stdout. Gloo prints its connection lines ("[Gloo] Rank 0 is connected to 1 peer
    ranks...") from C++ onto descriptor 1; this way they join the other diagnostics, and
    stdout carries only what dslc prints there (the run's summary), which scripts may read."""
    stdout = sys.stdout
    stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    try:
        with open(real, "w", buffering=1, encoding=stdout.encoding, errors=stdout.errors, closefd=False) as ours:
            sys.stdout = ours
            yield
    finally:
        sys.stdout = stdout
        os.dup2(real, 1)
        os.close(real)


def _check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator on every interface at the port; where the port is
    taken, jaxlib 0.10.2 crashes the process (SIGSEGV) instead of raising."""
    port = int(coordinator.rpartition(":")[2])
    try:
        with socket.socket() as probe:
            # As the coordinator's server does, so a port left in TIME_WAIT counts as free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("", port))
    except OSError as exc:
        raise DistributedError(
            f"process 0 cannot serve the coordinator at port {port}: {exc.strerror or exc}; choose another port"
        ) from None


def local_rows(program: Program) -> np.ndarray | None:
    """The rows of the batch that this process's devices hold, or None when it holds them
    all (a single process): the data sets then read only these rows."""
    import numpy as np
    from jax.sharding import NamedSharding

    size = program.ir.input(program.ir.stream).type.shape[0]
    rows: set[int] = set()
    for inp in program.module.INPUTS.values():
        sharding = NamedSharding(program.mesh, inp.sharding)
        for index in sharding.addressable_devices_indices_map(inp.shape).values():
            rows.update(range(*index[0].indices(size)) if index else range(size))
    return None if len(rows) == size else np.array(sorted(rows))
