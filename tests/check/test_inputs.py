"""Checking a batch against the spec's inputs, and `dslc run`/`init` on bad files.

A token id past the vocabulary, a negative class label or fractions where the spec declares
integers are refused with the input, the value and its index, before anything compiles;
files that are not .npz archives of plain arrays end with one line and exit 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dslc import cli
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.layers.inputs import InputError, check_inputs, read_inputs
from tests.conftest import SPECS

TINY = SPECS / "tiny.par"  # tokens, targets: i32[8, 32]; embed(256, 64); 256 logits


def checked(source: str | Path) -> ir.Program:
    analysis = analyze(source)
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


def tiny_batch() -> dict[str, np.ndarray]:
    tokens = np.arange(8 * 32, dtype=np.int32).reshape(8, 32) % 256
    return {"tokens": tokens, "targets": (tokens + 1) % 256}


def refusal(program: ir.Program, batch: dict[str, np.ndarray], loss: bool = True) -> str:
    with pytest.raises(InputError) as caught:
        check_inputs(program, batch, read_inputs(program, loss))
    return str(caught.value)


def test_a_valid_batch_passes_and_the_forward_pass_needs_no_targets() -> None:
    program = checked(TINY)
    batch = tiny_batch()
    check_inputs(program, batch, read_inputs(program, loss=True))
    check_inputs(program, {"tokens": batch["tokens"]}, read_inputs(program, loss=False))
    assert read_inputs(program, loss=True) == ("tokens", "targets")
    assert "missing input `targets` (the batch holds `tokens`)" in refusal(program, {"tokens": batch["tokens"]})


def test_ids_past_the_vocabulary_name_the_value_its_index_and_the_layer() -> None:
    program = checked(TINY)
    batch = tiny_batch()
    batch["tokens"][3, 17] = 999
    assert refusal(program, batch) == (
        "input `tokens` holds 999 at index [3, 17]: `embed` takes token ids 0 .. 255 (vocab 256)"
    )


def test_negative_targets_are_refused_and_counted() -> None:
    program = checked(TINY)
    batch = tiny_batch()
    batch["targets"][0, 2] = -5
    batch["targets"][7, 31] = -1
    assert refusal(program, batch) == (
        "input `targets` holds -5 at index [0, 2] (and 1 more out of range): "
        "`loss` takes class ids 0 .. 255 (256 logits), or -100 (not counted)"
    )


def test_fractions_for_an_integer_input_are_refused_not_cast() -> None:
    program = checked(TINY)
    batch = tiny_batch()
    batch["tokens"] = batch["tokens"].astype(np.float32) + 0.5
    assert refusal(program, batch) == (
        "input `tokens` is i32 in the spec, but the array holds float32 values; give it integers"
    )


def test_labels_of_a_classifier_are_bounded_by_its_logits() -> None:
    program = checked(SPECS / "seed_mlp_pipeline.par")  # 10 classes
    batch = {"images": np.zeros((32, 784), np.float32), "labels": np.full(32, 9, np.int64)}
    check_inputs(program, batch, read_inputs(program, loss=True))
    batch["labels"][30] = 10
    assert "holds 10 at index [30]: `loss` takes class ids 0 .. 9 (10 logits)" in refusal(program, batch)
    batch = {"images": np.array([["a"] * 784] * 32), "labels": batch["labels"]}
    assert "input `images` is f32 in the spec, but the array holds <U1" in refusal(program, batch)


def test_integers_nothing_indexes_must_still_fit_their_dtype() -> None:
    program = checked(
        "model m\nmesh data=1\ninput x: f32[2, 3]\ninput y: i32[2, 3]\nforward(x) {\n  relu()\n  loss: mse(y)\n}\n"
    )
    batch = {"x": np.zeros((2, 3), np.float32), "y": np.array([[1, 2, 3], [4, 2**40, -(2**40)]])}
    assert refusal(program, batch) == (
        f"input `y` holds {2**40} at index [1, 1] (and 1 more out of range): that does not fit i32"
    )
    batch["y"] = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)
    check_inputs(program, batch, read_inputs(program, loss=True))
    batch["y"][0, 0] = 2**63
    assert refusal(program, batch).startswith(f"input `y` holds {2**63} at index [0, 0]")


def test_the_program_checks_every_batch_it_places() -> None:
    import dslc

    program = dslc.compile(TINY)
    batch = tiny_batch()
    batch["tokens"][0, 0] = 256
    with pytest.raises(InputError, match=r"holds 256 at index \[0, 0\]"):
        program.place(batch)
    with pytest.raises(InputError, match="missing input `targets`"):
        program.place({"tokens": tiny_batch()["tokens"]}, loss=True)


# --- dslc run and init on bad files ----------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "w.npz"
    assert cli.main(["init", str(TINY), "-o", str(path)]) == 0
    return path


def bad_inputs(folder: Path) -> dict[str, tuple[Path, str]]:
    """Files that `dslc run` must refuse, and what it must say."""
    good = tiny_batch()
    np.savez(folder / "good.npz", **good)
    whole = (folder / "good.npz").read_bytes()
    cases = {
        "truncated": (whole[: len(whole) // 2], "cannot read {}: File is not a zip file (a damaged or truncated"),
        "random": (os.urandom(512), "{} is not an .npz archive"),
        "empty": (b"", "{} is not an .npz archive"),
    }
    out = {}
    for name, (data, message) in cases.items():
        (folder / f"{name}.npz").write_bytes(data)
        out[name] = (folder / f"{name}.npz", message)
    np.savez(folder / "objects.npz", tokens=np.array([{"a": 1}], dtype=object))
    out["objects"] = (folder / "objects.npz", "{} holds arrays of Python objects, which are never unpickled")
    np.savez(folder / "untargeted.npz", tokens=good["tokens"])
    out["untargeted"] = (folder / "untargeted.npz", "missing input `targets` (the batch holds `tokens`)")
    np.savez(folder / "vocab.npz", tokens=good["tokens"] + 999, targets=good["targets"])
    out["vocab"] = (folder / "vocab.npz", "input `tokens` holds 999 at index [0, 0] (and 255 more out of range)")
    return out


@pytest.mark.parametrize("case", ["truncated", "random", "empty", "objects", "untargeted", "vocab"])
def test_run_refuses_bad_inputs_in_one_line_with_exit_1(
    case: str, weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, message = bad_inputs(tmp_path)[case]
    out = tmp_path / "y.npz"
    code = cli.main(["run", str(TINY), "--weights", str(weights), "--inputs", str(path), "-o", str(out), "--grads"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("dslc: error: " + message.format(path)) and err.count("\n") == 1, err
    assert "allow_pickle" not in err and not out.exists()


def test_run_and_init_refuse_folders_and_missing_files_as_usage_errors(
    weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", str(TINY), "--weights", str(weights), "-o", str(tmp_path / "y.npz"), "--inputs"]
    assert cli.main([*argv, str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"dslc: error: {tmp_path} is a folder, not a file\n"
    assert cli.main([*argv, str(tmp_path / "nope.npz")]) == 2
    assert capsys.readouterr().err == f"dslc: error: no such file: {tmp_path / 'nope.npz'}\n"
    assert cli.main(["init", str(TINY), "-o", str(tmp_path / "none" / "w.npz")]) == 2
    assert capsys.readouterr().err == f"dslc: error: no such folder: {tmp_path / 'none'}\n"
    assert cli.main(["init", str(TINY), "--seed", "-1", "-o", str(tmp_path / "w.npz")]) == 2
    assert "expected a whole number" in capsys.readouterr().err
