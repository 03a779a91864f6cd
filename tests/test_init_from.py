"""`dslc train --init-from`: a new run starts from given weights, a .npz or a checkpoint folder.

The loss a training step reports is the loss before its update, so the first step's is the
given weights' loss on the first batch (tiny has no dropout: the training loss is the plain
one). Tolerance 1e-5 relative: the training step and `Program.loss` are two compilations of
the same f32 computation (measured: 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dslc
from dslc.cli import main
from dslc.train.data import dataset_for
from dslc.train.init_from import initial_weights
from tests.conftest import SPECS
from tests.hf_checkpoints import GPT2_CONFIG, GPT2_SET, gpt2_tensors, write_checkpoint

TINY = SPECS / "tiny.par"


def first_loss(run: Path) -> float:
    return float(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"])


def test_a_run_starts_from_the_given_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["init", str(TINY), "--seed", "7", "-o", str(tmp_path / "w.npz")]) == 0
    assert (
        main(
            ["train", str(TINY), "--init-from", str(tmp_path / "w.npz"), "--steps", "1", "--out", str(tmp_path / "run")]
        )
        == 0
    )
    program = dslc.compile(TINY)
    model = program.init(0)
    with np.load(tmp_path / "w.npz") as weights:
        program.import_weights(model, {n: weights[n] for n in weights.files})
    want = float(program.loss(model, dataset_for(program.ir).batch(0, 0)))
    assert first_loss(tmp_path / "run") == pytest.approx(want, rel=1e-5)
    seeded = float(program.loss(program.init(0), dataset_for(program.ir).batch(0, 0)))
    assert abs(want - seeded) > 1e-3  # the run did not start from its own seed's weights


def test_a_checkpoint_folder_gives_the_weights_import_writes(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "gpt2", GPT2_CONFIG, gpt2_tensors(GPT2_CONFIG))
    analysis = dslc.analyze(SPECS / "gpt2.par", overrides=GPT2_SET)
    assert main(["import", str(SPECS / "gpt2.par"), str(folder), "-o", str(tmp_path / "w.npz"), *_set(GPT2_SET)]) == 0
    got = initial_weights(folder, analysis)
    with np.load(tmp_path / "w.npz") as want:
        assert sorted(got) == sorted(want.files)
        assert all(np.array_equal(got[n], want[n]) for n in want.files)


@pytest.mark.parametrize(
    ("extra", "code", "said"),
    [
        (["--resume"], 2, "--init-from starts a new run"),
        (["--init-from-missing"], 2, "no such file or folder"),
        (["--config-disagrees"], 1, "error[C001]: config.json's `n_layer` is 3"),
        (["--not-an-npz"], 1, "cannot read weights from"),
        (["--other-spec"], 1, "error[C007]: the weights do not fit the spec"),
    ],
)
def test_weights_that_cannot_start_a_run_are_refused(
    extra: list[str], code: int, said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec, sizes = SPECS / "gpt2.par", GPT2_SET
    source = write_checkpoint(tmp_path / "gpt2", GPT2_CONFIG, gpt2_tensors(GPT2_CONFIG))
    argv = ["--steps", "1", "--out", str(tmp_path / "run")]
    match extra:
        case ["--resume"]:
            argv.append("--resume")
        case ["--init-from-missing"]:
            source = tmp_path / "nowhere"
        case ["--config-disagrees"]:
            source = write_checkpoint(tmp_path / "deeper", {**GPT2_CONFIG, "n_layer": 3}, gpt2_tensors(GPT2_CONFIG))
        case ["--not-an-npz"]:
            source = tmp_path / "w.npz"
            source.write_text("not an archive")
        case ["--other-spec"]:
            spec, sizes = TINY, {}
            source = tmp_path / "w.npz"
            np.savez(source, **{"embed.table": np.zeros((3, 3), np.float32)})
    assert main(["train", str(spec), "--init-from", str(source), *argv, *_set(sizes)]) == code
    assert said in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _set(values: dict[str, object]) -> list[str]:
    return [part for name, value in values.items() for part in ("--set", f"{name}={value}")]
