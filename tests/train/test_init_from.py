"""Weights into and out of training runs: `dslc train --init-from` starts a new run from given
weights (a .npz or a checkpoint folder), and `dslc export --weights RUN` takes the newest
checkpoint of a run.

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
from dslc.interop import CheckpointError
from dslc.train.data import dataset_for
from dslc.train.weights import initial_weights, trained_weights
from tests.conftest import SPECS
from tests.hf_checkpoints import GPT2_CONFIG, GPT2_SET, gpt2_tensors, write_checkpoint

TINY = SPECS / "tiny.par"


def first_loss(run: Path) -> float:
    return float(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of tiny from the weights of seed 7, a checkpoint after each."""
    where = tmp_path_factory.mktemp("run")
    assert main(["init", str(TINY), "--seed", "7", "-o", str(where / "w.npz")]) == 0
    argv = ["--init-from", str(where / "w.npz"), "--steps", "2", "--checkpoint-every", "1", "--out", str(where / "run")]
    assert main(["train", str(TINY), *argv]) == 0
    return where


def test_a_run_starts_from_the_given_weights(run: Path) -> None:
    program = dslc.compile(TINY)
    model = program.init(0)
    with np.load(run / "w.npz") as weights:
        program.import_weights(model, {n: weights[n] for n in weights.files})
    want = float(program.loss(model, dataset_for(program.ir).batch(0, 0)))
    assert first_loss(run / "run") == pytest.approx(want, rel=1e-5)
    seeded = float(program.loss(program.init(0), dataset_for(program.ir).batch(0, 0)))
    assert abs(want - seeded) > 1e-3  # the run did not start from its own seed's weights


def test_a_run_gives_its_newest_checkpoint_for_export(run: Path, tmp_path: Path) -> None:
    program = dslc.compile(TINY)
    step, trained = trained_weights(program, run / "run")
    assert step == 2
    with np.load(run / "w.npz") as start:
        assert sorted(trained) == sorted(start.files)
        assert all(not np.array_equal(trained[n], start[n]) for n in start.files)  # Adam moves every weight
    # Without checkpoint 2, checkpoint 1 is the newest: the start itself, since the first step
    # of tiny's warm-up has a learning rate of 0.
    (run / "run" / "checkpoints" / "2").rename(tmp_path / "later")
    step, first = trained_weights(program, run / "run")
    with np.load(run / "w.npz") as start:
        assert step == 1 and all(np.array_equal(first[n], start[n]) for n in start.files)


def test_a_run_folder_gives_dslc_run_its_weights(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dslc run --weights RUN` runs the run's newest checkpoint, as `dslc export` takes it."""
    program = dslc.compile(TINY)
    batch = program.example_batch(3)
    np.savez(tmp_path / "x.npz", **batch)
    argv = ["run", str(TINY), "--weights", str(run / "run"), "--inputs", str(tmp_path / "x.npz")]
    assert main([*argv, "-o", str(tmp_path / "y.npz")]) == 0
    step, weights = trained_weights(program, run / "run")  # another test takes checkpoint 2 away
    assert f"the parameters of checkpoint {step}" in capsys.readouterr().err
    model = program.init(0)
    program.import_weights(model, weights)
    with np.load(tmp_path / "y.npz") as out:
        np.testing.assert_array_equal(out["output"], np.asarray(program.forward(model, batch)))
    not_a_run = ["run", str(TINY), "--weights", str(tmp_path), "--inputs", str(tmp_path / "x.npz")]
    assert main([*not_a_run, "-o", str(tmp_path / "z.npz")]) == 1
    assert "error[C007]: holds no checkpoint of a `dslc train` run" in capsys.readouterr().err


def test_a_folder_without_a_run_is_not_exported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        ["export", str(SPECS / "gpt2.par"), "--weights", str(tmp_path), "-o", str(tmp_path / "out"), *_set(GPT2_SET)]
    )
    assert code == 1
    assert "error[C007]: holds no checkpoint of a `dslc train` run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_folder_gives_the_weights_import_writes(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "gpt2", GPT2_CONFIG, gpt2_tensors(GPT2_CONFIG))
    analysis = dslc.analyze(SPECS / "gpt2.par", overrides=GPT2_SET)
    assert main(["import", str(SPECS / "gpt2.par"), str(folder), "-o", str(tmp_path / "w.npz"), *_set(GPT2_SET)]) == 0
    got = initial_weights(folder, analysis)
    with np.load(tmp_path / "w.npz") as want:
        assert sorted(got) == sorted(want.files)
        assert all(np.array_equal(got[n], want[n]) for n in want.files)


def test_a_run_of_another_shape_is_refused_for_export(run: Path) -> None:
    # The checkpoint holds stacked storage (`layers.*.attn.q`); a wider model's differs in shape.
    wider = dslc.compile(TINY, overrides={"d": 128})
    with pytest.raises(CheckpointError, match="does not fit the spec"):
        trained_weights(wider, run / "run")


@pytest.mark.parametrize(
    ("extra", "code", "said"),
    [
        (["--resume"], 2, "--init-from starts a new run"),
        (["--init-from-missing"], 2, "no such file or folder"),
        (["--config-disagrees"], 1, "error[C001]: config.json's `n_layer` is 3"),
        (["--not-an-npz"], 1, "cannot read weights from"),
        (["--notes"], 1, "notes.txt is not an .npz archive"),
        (["--one-file-of-a-checkpoint"], 1, "is one file of a Hugging Face checkpoint, not an .npz archive: give the"),
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
        case ["--notes"]:
            source = tmp_path / "notes.txt"
            source.write_text("to do: fine-tune\n")
        case ["--one-file-of-a-checkpoint"]:
            source = source / "model.safetensors"
        case ["--other-spec"]:
            spec, sizes = TINY, {}
            source = tmp_path / "w.npz"
            np.savez(source, **{"embed.table": np.zeros((3, 3), np.float32)})
    assert main(["train", str(spec), "--init-from", str(source), *argv, *_set(sizes)]) == code
    err = capsys.readouterr().err
    assert said in err
    assert "pickle" not in err  # numpy's advice for a file it cannot read
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _set(values: dict[str, object]) -> list[str]:
    return [part for name, value in values.items() for part in ("--set", f"{name}={value}")]
