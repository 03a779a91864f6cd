"""`dslc train` across processes: JAX's multi-process runtime on localhost, gloo between CPUs.

Two processes of 8 simulated CPU devices each form one 4x4 mesh of specs/tiny.par, train,
and must follow a single-process run on 16 devices; the checkpoint they write together then
resumes in one process. Each process stands for a node: with tiny's mesh as written, data=4
spans both processes and model=4 stays within each; with `model` declared `across 2 nodes`,
the other way round.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from dslc.cli import main
from dslc.train.distributed import Cluster, detect_cluster
from tests.conftest import ROOT, SPECS

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

TINY = ["train", str(SPECS / "tiny.par"), "--mesh", "4x4"]
TINY_TEXT = (SPECS / "tiny.par").read_text()
# tiny with its tensor-parallel axis declared across nodes: not what a cluster wants (the
# slow network then carries every layer's collectives), but a layout unlike the one a mesh
# gets without the clause, so that the test can tell the two apart.
MODEL_ACROSS = TINY_TEXT.replace("mesh data=2, model=2", "mesh data=2, model=2 across 2 nodes")
# Which process holds each device of the mesh, as the program `dslc train` runs lays it out.
MESH_OWNERS = """
import json, sys
import dslc
from dslc.train.distributed import Cluster, joined
with joined(Cluster(2, int(sys.argv[3]), sys.argv[2], None), 16):
    program = dslc.compile(sys.argv[1], mesh="4x4")
    print(json.dumps([[d.process_index for d in row] for row in program.mesh.devices]))
"""
PROCESSES = 2
# A metrics file or loss curve that a process writes is replaced into place (files.write_atomic):
# an audit hook on os.rename tells which process wrote which, without a hook in dslc itself.
WATCHED_CLI = """
import sys
def report_replaced(event, args):
    if event == "os.rename" and str(args[1]).endswith(("metrics.jsonl", "loss.png")):
        print("replaced", args[1], file=sys.stderr, flush=True)
sys.addaudithook(report_replaced)
from dslc.cli import entry
entry()
"""


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_processes(
    run: Path, steps: int, train: Sequence[str] = TINY
) -> tuple[list[subprocess.Popen[bytes]], list[tuple[Path, Path]]]:
    """The PROCESSES processes of one run, and each one's (stdout, stderr) files."""
    port = free_port()
    logs = [(run.with_name(f"{run.name}.{i}.out"), run.with_name(f"{run.name}.{i}.err")) for i in range(PROCESSES)]
    children = []
    for i, (out, err) in enumerate(logs):
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(PROCESSES), "--process-id", str(i)]
        argv = [sys.executable, "-c", WATCHED_CLI, *train, "--steps", str(steps), "--out", str(run), *flags]
        with out.open("w") as stdout, err.open("w") as stderr:
            children.append(subprocess.Popen(argv, cwd=ROOT, stdout=stdout, stderr=stderr))
    return children, logs


def wait_for(children: list[subprocess.Popen[bytes]], logs: list[tuple[Path, Path]], codes: set[int]) -> None:
    """Until every process has ended; one that ends with a status outside `codes`, or a run
    past its time, fails the test."""
    deadline = time.monotonic() + 240
    while any(child.poll() is None for child in children):
        failed = [child for child in children if child.returncode not in (None, *codes)]
        assert not failed and time.monotonic() < deadline, [e.read_text()[-3000:] for _, e in logs]
        time.sleep(0.1)


def train_in_processes(run: Path, steps: int, train: Sequence[str] = TINY) -> list[tuple[str, str]]:
    """(stdout, stderr) of each process of a PROCESSES-process run; any failure kills them all."""
    children, logs = start_processes(run, steps, train)
    try:
        wait_for(children, logs, {0})
    finally:
        for child in children:
            child.kill()
            child.wait()
    texts = [(out.read_text(), err.read_text()) for out, err in logs]
    assert [child.returncode for child in children] == [0] * PROCESSES, [err[-3000:] for _, err in texts]
    return texts


def test_two_processes_train_as_one_and_only_process_0_reports(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Run on the layout `model across 2 nodes` gives (each process a node), against tiny's own
    layout in one process: the numbers must not depend on where the devices sit."""
    reference, run, spec = tmp_path / "reference", tmp_path / "run", tmp_path / "tiny.par"
    spec.write_text(MODEL_ACROSS)
    across = ["train", str(spec), "--mesh", "4x4"]
    assert main([*TINY, "--steps", "6", "--out", str(reference)]) == 0  # 16 devices in this process
    expected = losses(reference)
    capsys.readouterr()

    (out0, err0), (out1, err1) = train_in_processes(run, steps=4, train=across)

    # Seen: steps 1-3 equal to the bit, step 4's loss 9.5e-7 (1.8e-7 relative) off, its
    # cross-process sum being added in another order (steps 5 and 6 of a longer run were
    # exact again). 1e-5 leaves room for that rounding and is far below what wrong data
    # would do: rows 4-7 (process 1's half) taken from another step's batch moved the loss
    # by 6.5e-3 relative at step 1 and 2.4e-2 at step 2.
    multi = losses(run)
    assert sorted(multi) == [1, 2, 3, 4]
    for step, loss in multi.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step

    # Process 0 alone reports: the log, the progress, the summary, the metrics and the curve.
    assert "training tiny on mesh 4x4 (data, model; model across 2 nodes)" in err0
    assert "step 1: compiled and ran in" in err0
    assert "trained tiny on mesh 4x4 (data, model; model across 2 nodes), steps 1-4" in out0
    assert f"replaced {run / 'metrics.jsonl'}" in err0 and f"replaced {run / 'loss.png'}" in err0
    # Gloo prints "[Gloo] Rank r is connected to k peer ranks..." lines on its own, onto
    # stderr: stdout carries only process 0's summary.
    assert out1 == "" and "[Gloo]" not in out0, (out0, out1)
    own1 = re.sub(r"\[Gloo\][^\n]*", "", err1)
    assert not re.search(r"train|step|loss|replaced|wrote", own1), own1
    # Every process wrote its own shards of the checkpoint (orbax's OCDBT layout).
    state = run / "checkpoints" / "4" / "state"
    assert sorted(p.name for p in state.glob("ocdbt.process_*")) == [f"ocdbt.process_{i}" for i in range(PROCESSES)]

    # One process resumes what two wrote, on its own 16 devices (simulating the two nodes),
    # as if never interrupted.
    assert main([*across, "--steps", "6", "--resume", "--out", str(run)]) == 0
    assert "resumed from the checkpoint at step 4" in capsys.readouterr().err
    resumed = losses(run)
    for step in (5, 6):  # seen: exact
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.parametrize(
    ("text", "owner"),
    [
        # As written, tiny's mesh lays `data` (the first axis) across the processes.
        (TINY_TEXT, lambda data, model: data // 2),
        (MODEL_ACROSS, lambda data, model: model // 2),
    ],
    ids=["as-written", "model-across-nodes"],
)
def test_the_axis_declared_across_nodes_is_the_one_across_processes(
    tmp_path: Path, text: str, owner: Callable[[int, int], int]
) -> None:
    spec = tmp_path / "tiny.par"
    spec.write_text(text)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MESH_OWNERS, str(spec), f"127.0.0.1:{port}", str(i)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, [err[-3000:] for _, err in outputs]
    for out, _ in outputs:  # every process sees the same global mesh
        owners = json.loads(out.strip().splitlines()[-1])
        assert owners == [[owner(data, model) for model in range(4)] for data in range(4)], owners


def test_sigterm_to_one_process_stops_every_process_after_the_same_step_with_its_shards_saved(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A preemption need not reach every process at once: the processes agree after each
    step, so all of them finish the same step, write their shards of its checkpoint, and
    stop; one process then resumes it on the uninterrupted trajectory."""
    run = tmp_path / "run"
    children, logs = start_processes(run, steps=100_000)
    try:
        deadline = time.monotonic() + 240
        while "compiled and ran" not in logs[0][1].read_text():
            assert all(c.poll() is None for c in children) and time.monotonic() < deadline, logs[0][1].read_text()
            time.sleep(0.1)
        os.kill(children[1].pid, signal.SIGTERM)
        wait_for(children, logs, {143})
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert [child.returncode for child in children] == [143] * PROCESSES
    (out0, err0), (out1, _) = [(out.read_text(), err.read_text()) for out, err in logs]
    step = int(out0.split("stopped at step ")[1].split(",")[0])
    # Each process says how it continues: the same line but for its own process id.
    assert out1.startswith(f"stopped at step {step}, checkpoint saved") and "--process-id 1" in out1
    assert "--process-id 0" in out0 and "Traceback" not in err0
    state = run / "checkpoints" / str(step) / "state"
    assert sorted(p.name for p in state.glob("ocdbt.process_*")) == [f"ocdbt.process_{i}" for i in range(PROCESSES)]

    reference = tmp_path / "reference"
    assert main([*TINY, "--steps", str(step + 2), "--out", str(reference)]) == 0
    assert main([*TINY, "--steps", str(step + 2), "--resume", "--out", str(run)]) == 0
    assert f"resumed from the checkpoint at step {step}" in capsys.readouterr().err
    expected, resumed = losses(reference), losses(run)
    for at in (step + 1, step + 2):  # the tolerance of the test above, for the same rounding
        assert resumed[at] == pytest.approx(expected[at], rel=1e-5), at


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "127.0.0.1:7000"], "--num-processes and --process-id missing"),
        (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
        (["--coordinator", "h:70000", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
        (["--coordinator", "h:7000", "--num-processes", "0", "--process-id", "0"], "at least 1"),
        (["--coordinator", "h:7000", "--num-processes", "2", "--process-id", "2"], "the processes are 0 to 1, not 2"),
        (["--coordinator", "h:7000", "--num-processes", "2", "--process-id", "-1"], "expected a whole number"),
        # The spec's default mesh is 2x2: 4 devices, which 3 processes cannot share.
        (["--coordinator", "h:7000", "--num-processes", "3", "--process-id", "1"], "4 devices, which do not split"),
    ],
)
def test_bad_process_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    code = main(["train", str(SPECS / "tiny.par"), "--steps", "1", "--out", str(tmp_path), *flags])
    assert code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing written"


def test_coordinator_port_in_use_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"]
        code = main(["train", str(SPECS / "tiny.par"), "--steps", "1", "--out", str(tmp_path), *flags])
    assert code == 2 and f"cannot serve the coordinator at port {port}" in capsys.readouterr().err


SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({**SLURM_STEP, "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, Cluster(4, 2, None, "slurm")),
        ({**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # one task: nothing to join
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, None),  # a batch script, not an srun step
        (
            {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
            Cluster(2, 1, None, "ompi"),
        ),
        (  # mpirun inside a Slurm step: jax tries Open MPI first
            {
                **SLURM_STEP,
                "SLURM_NTASKS": "1",
                "SLURM_PROCID": "0",
                "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "0",
            },
            Cluster(2, 0, None, "ompi"),
        ),
    ],
)
def test_launcher_environments_jax_detects(environ: dict[str, str], expected: Cluster | None) -> None:
    assert detect_cluster(environ) == expected
