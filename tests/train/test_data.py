"""`dslc train --data`: token files and text, held-out evaluation, exact resume, Ctrl-C.

The training runs use specs/tiny.par (vocab 256, batches of 8 x 32 tokens) for a few steps
on data made here: a token sequence with a short period, which a model learns within tens of
steps, and a folder of text files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dslc.cli import main
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.train import tokens as tokens_module
from dslc.train.data import dataset_for
from dslc.train.dataset import DataError
from dslc.train.tokens import HELD_OUT, NextTokens, TokenStream, open_data
from tests.conftest import ROOT, SPECS

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

TINY = str(SPECS / "tiny.par")
PERIOD = 61  # the token sequence repeats every PERIOD tokens


def checked(source: str | Path) -> ir.Program:
    analysis = analyze(source)
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


def periodic_tokens(count: int = 200_000) -> np.ndarray:
    return ((np.arange(count) * 37) % PERIOD * 4).astype(np.uint16)  # ids 0 .. 240


def write_text_folder(folder: Path) -> Path:
    folder.mkdir()
    lines = [
        f"the {animal} {verb} over the {thing}.\n"
        for animal in ("cat", "dog", "fox")
        for verb in ("jumps", "looks", "runs")
        for thing in ("fence", "wall", "river", "log")
    ]
    for i in range(40):
        (folder / f"part{i:02d}.txt").write_text("".join(lines[(i + j) % len(lines)] for j in range(60)))
    (folder / ".hidden").write_text("never read")
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(100))  # binary: skipped
    return folder


def rows_of(run: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", TINY, *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# --- reading ---------------------------------------------------------------------------------


def test_token_files_are_mapped_not_read_and_split_off_a_held_out_tail(tmp_path: Path) -> None:
    tokens = periodic_tokens()
    tokens.tofile(tmp_path / "train.bin")
    data = open_data(tmp_path / "train.bin", vocab=256)
    assert isinstance(data.train.parts[0], np.memmap)
    assert len(data.held_out) == int(len(tokens) * HELD_OUT) and len(data.train) + len(data.held_out) == len(tokens)
    np.testing.assert_array_equal(data.held_out.window(0, 5), tokens[len(data.train) : len(data.train) + 5])
    np.save(tmp_path / "tokens.npy", tokens.astype(np.uint32))
    assert open_data(tmp_path / "tokens.npy", vocab=256).train.parts[0].dtype == np.uint32
    # A vocabulary beyond uint16 reads .bin files as uint32.
    tokens.astype(np.uint32).tofile(tmp_path / "wide.bin")
    assert open_data(tmp_path / "wide.bin", vocab=100_000).train.parts[0].dtype == np.uint32


def test_a_folder_with_train_and_val_is_nanogpts_layout(tmp_path: Path) -> None:
    periodic_tokens(5000).tofile(tmp_path / "train.bin")
    periodic_tokens(700).tofile(tmp_path / "val.bin")
    data = open_data(tmp_path, vocab=256)
    assert (len(data.train), len(data.held_out)) == (5000, 700)
    assert "val.bin (700, held out)" in data.description


def test_text_is_read_byte_level_across_files_skipping_hidden_and_binary_ones(tmp_path: Path) -> None:
    folder = write_text_folder(tmp_path / "text")
    data = open_data(folder, vocab=256)
    text = b"\n".join(p.read_bytes() for p in sorted(folder.glob("part*.txt")))
    assert len(data.train) + len(data.held_out) == len(text)
    # A window across the boundary between two files reads both, with the newline between.
    first = (folder / "part00.txt").stat().st_size
    np.testing.assert_array_equal(data.train.window(first - 3, 7), np.frombuffer(text[first - 3 : first + 4], np.uint8))
    assert "40 files" in data.description


def test_a_process_reads_only_its_own_rows(tmp_path: Path) -> None:
    program = checked(TINY)
    stream = TokenStream((periodic_tokens(10_000),), byte_level=False)
    data = NextTokens(stream, 256, program.input("tokens"), program.input("targets"), "periodic", "")
    whole = data.batch(3, 7)
    read: list[int] = []
    original = TokenStream.window

    def counting(self: TokenStream, start: int, length: int) -> np.ndarray:
        read.append(start)
        return original(self, start, length)

    mine = np.array([2, 5])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenStream, "window", counting)
        part = data.batch(3, 7, mine)
    assert len(read) == 2
    for name in ("tokens", "targets"):
        np.testing.assert_array_equal(part[name][mine], whole[name][mine])
        assert not part[name][[0, 1, 3, 4, 6, 7]].any()
    np.testing.assert_array_equal(whole["targets"][:, :-1], whole["tokens"][:, 1:])


def unusable(kind: str, folder: Path) -> Path:
    """A path that --data must refuse, of the given kind."""
    match kind:
        case "missing":
            return folder / "missing.bin"
        case "odd":
            (folder / "odd.bin").write_bytes(b"abc")
            return folder / "odd.bin"
        case "floats":
            np.save(folder / "f.npy", np.zeros(9, np.float32))
            return folder / "f.npy"
        case "matrix":
            np.save(folder / "m.npy", np.zeros((3, 3), np.int32))
            return folder / "m.npy"
        case "empty":
            (folder / "e").mkdir()
            return folder / "e"
        case _:
            periodic_tokens(9).tofile(folder / "train.bin")
            return folder


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "no such file or folder"),
        ("odd", "3 bytes is not a whole number of uint16 ids"),
        ("floats", "a token file is a flat array of integer ids, this one is float32[9]"),
        ("matrix", "this one is int32[3x3]"),
        ("empty", "the folder holds no text files (nor train.bin and val.bin)"),
        ("no-val", "it holds train.bin but no val.bin (the held-out split)"),
    ],
)
def test_unusable_data_is_refused_with_what_is_wrong(tmp_path: Path, kind: str, message: str) -> None:
    path = unusable(kind, tmp_path)
    with pytest.raises(DataError) as caught:
        dataset_for(checked(TINY), path)
    assert str(caught.value).startswith(f"--data {path}: ") and message in str(caught.value)


def test_ids_beyond_the_vocabulary_in_a_batch_name_their_position() -> None:
    # open_data refuses such a file before training; a batch still checks its windows, for
    # a file rewritten under a running process.
    program = checked(TINY)
    tokens = periodic_tokens(5000)
    tokens[1234] = 300
    stream = TokenStream((tokens,), byte_level=False)
    data = NextTokens(stream, 256, program.input("tokens"), program.input("targets"), "t.bin", "")
    with pytest.raises(DataError, match=r"token id 300 at position 1,234 \(step \d+\) is not below .* 256"):
        for step in range(100):
            data.batch(0, step)


@pytest.mark.parametrize(
    ("name", "dtype", "position", "value"),
    [
        ("first.bin", np.uint16, 0, 256),
        ("end-of-chunk.bin", np.uint16, 999, 65535),
        ("next-chunk.bin", np.uint16, 1000, 300),
        ("last.bin", np.uint16, 4999, 256),
        ("negative.npy", np.int32, 2500, -1),
    ],
)
def test_a_token_file_is_checked_whole_a_slice_at_a_time_when_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, dtype: type, position: int, value: int
) -> None:
    monkeypatch.setattr(tokens_module, "CHECK_CHUNK", 1000)  # five slices
    tokens = periodic_tokens(5000).astype(dtype)
    tokens[position] = value
    tokens[position + 1 :: 700] = 257  # later offenders: the first is the one named
    path = tmp_path / name
    if path.suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    with pytest.raises(DataError) as caught:
        open_data(path, vocab=256)
    assert str(caught.value) == (
        f"--data {path}: token id {value} at position {position:,} is outside the spec's vocabulary of 256 "
        "(ids 0 .. 255)"
    )


def test_the_held_out_file_of_a_folder_is_checked_too(tmp_path: Path) -> None:
    periodic_tokens(5000).tofile(tmp_path / "train.bin")
    held_out = periodic_tokens(700)
    held_out[650] = 1000
    held_out.tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match=r"^--data .*val\.bin: token id 1000 at position 650 is outside"):
        open_data(tmp_path, vocab=256)


# --- training ----------------------------------------------------------------------------------


def test_a_token_file_trains_with_a_falling_held_out_loss_and_resumes_exactly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    periodic_tokens().tofile(tmp_path / "tokens.bin")
    data = ["--data", str(tmp_path / "tokens.bin"), "--eval-every", "10"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    code, _, err = train(capsys, *data, "--steps", "30", "--out", str(whole))
    assert code == 0, err
    held_out = {r["step"]: r["eval_loss"] for r in rows_of(whole) if "eval_loss" in r}
    # Seen: 3.39, 1.09, 0.30 at steps 10, 20, 30 (the sequence has 61 distinct ids).
    assert list(held_out) == [10, 20, 30] and held_out[30] < held_out[10] / 2, held_out
    assert f"token file {tmp_path / 'tokens.bin'} (200,000 tokens, uint16)" in err
    assert train(capsys, *data, "--steps", "20", "--out", str(part))[0] == 0
    assert train(capsys, *data, "--steps", "30", "--resume", "--out", str(part))[0] == 0
    # Bitwise: the position in the data is the step, restored with the checkpoint.
    assert rows_of(part)[-1]["loss"] == rows_of(whole)[-1]["loss"]
    assert [r.get("eval_loss") for r in rows_of(part)] == [r.get("eval_loss") for r in rows_of(whole)]


def test_a_text_folder_trains_byte_level_with_a_falling_held_out_loss(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = write_text_folder(tmp_path / "text")
    code, _, err = train(
        capsys, "--data", str(folder), "--eval-every", "15", "--steps", "30", "--out", str(tmp_path / "r")
    )
    assert code == 0, err
    held_out = {r["step"]: r["eval_loss"] for r in rows_of(tmp_path / "r") if "eval_loss" in r}
    # Seen: 2.37 and 1.01 at steps 15 and 30.
    assert list(held_out) == [15, 30] and held_out[30] < held_out[15] - 0.5, held_out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--data", "nowhere.bin"), "--data nowhere.bin: no such file or folder"),
        (("--eval-every", "0"), "--eval-every must be at least 1"),
        ((str(SPECS / "seed_mlp_pipeline.par"), "--data", TINY), "classifies images and this is a text or token file"),
        ((str(SPECS / "seed_tp_layer.par"), "--data", TINY), "--data feeds language models (integer tokens"),
    ],
)
def test_bad_data_flags_end_with_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    code = main(["train", *argv, "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_ctrl_c_saves_a_checkpoint_and_prints_how_to_resume(tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "err"
    command = [sys.executable, "-m", "dslc.cli", "train", TINY, "--steps", "100000", "--out", str(run)]
    with log.open("w") as stderr:
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 180
            while "compiled and ran" not in log.read_text():
                assert child.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            os.kill(child.pid, signal.SIGINT)
            out, _ = child.communicate(timeout=120)
        finally:
            child.kill()
    assert child.returncode == 130, log.read_text()
    step = int(out.split("stopped at step ")[1].split(",")[0])
    assert out == (
        f"stopped at step {step}, checkpoint saved; to continue:\n"
        f"  dslc train {TINY} --steps 100000 --out {run} --resume\n"
    )
    assert (run / "checkpoints" / str(step)).is_dir() and len(rows_of(run)) == step
    assert "stopping after this step" in log.read_text() and "Traceback" not in log.read_text()


def test_an_id_beyond_the_vocabulary_anywhere_in_a_token_file_stops_the_run_before_it_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # One bad id in 200,000: a run of a step or two would never sample it, a long one only
    # hours in. The whole file is checked before any step compiles, so this ends in seconds.
    tokens = periodic_tokens()
    tokens[123_456] = 300  # an id of a larger tokenizer
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    began = time.monotonic()
    code = main(["train", TINY, "--data", str(path), "--steps", "2", "--out", str(tmp_path / "r")])
    seconds = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [
        f"dslc: error: --data {path}: token id 300 at position 123,456 is outside the spec's vocabulary of 256 "
        "(ids 0 .. 255)"
    ], err
    assert not (tmp_path / "r").exists()
    assert seconds < 30, seconds  # seen: 0.2 s (jax already started); compiling the step takes longer


# --- documents packed into sequences ---------------------------------------------------------

# tiny with its attention reading document ids and its loss their mask, its sequence long
# enough to cross documents: the flash core (the spec's choice), which keeps a query to its
# own document.
PACKED = (
    (SPECS / "tiny.par")
    .read_text()
    .replace(
        "input targets: i32[batch @ data, seq]",
        "input targets: i32[batch @ data, seq]\n"
        "input docs: i32[batch @ data, seq]\n"
        "input counted: i8[batch @ data, seq]",
    )
    .replace("attention(d, heads)", "attention(d, heads, kernel=flash, segments=docs)")
    .replace("cross_entropy(targets)", "cross_entropy(targets, mask=counted)")
)


def test_a_window_packs_the_documents_it_crosses(tmp_path: Path) -> None:
    """Three files, each a document: a window's document ids change where a file ends (its
    joining newline is its own), and a position whose target begins the next document is
    not counted."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, letter in (("a.txt", "a"), ("b.txt", "b"), ("c.txt", "c")):
        (folder / name).write_text(letter * 40)
    program = checked(PACKED)
    dataset = dataset_for(program, folder)
    assert isinstance(dataset, NextTokens)
    batch = dataset.batch(0, 0)
    letters = {ord("a"): 0, ord("b"): 1, ord("c"): 2}
    for row in range(8):
        tokens, targets = batch["tokens"][row], batch["targets"][row]
        window = np.concatenate([tokens, targets[-1:]])
        # A letter's file is its document; a joining newline belongs to the file before it.
        owner = [letters.get(int(t), -1) for t in window]
        for i in range(len(owner)):
            if owner[i] < 0:
                owner[i] = owner[i - 1] if i else letters[int(window[1])] - 1
        docs = np.asarray(owner) - owner[0]
        np.testing.assert_array_equal(batch["docs"][row], docs[:-1])
        np.testing.assert_array_equal(batch["counted"][row], (docs[1:] == docs[:-1]).astype(np.int8))
    assert batch["counted"].dtype == np.int8 and batch["docs"].dtype == np.int32


def test_an_end_of_document_id_ends_a_document_in_a_token_file(tmp_path: Path) -> None:
    ids = np.asarray([5, 6, 7, 0, 8, 9, 0, 0, 3, 4] * 50, np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    stream = open_data(tmp_path / "tokens.bin", vocab=256, document_end=0).train
    # The id that ends a document is its last token; the next begins after it.
    np.testing.assert_array_equal(stream.documents(0, 10), [0, 0, 0, 0, 1, 1, 1, 2, 3, 3])
    np.testing.assert_array_equal(stream.documents(5, 4), [0, 0, 1, 2])
    assert len(open_data(tmp_path / "tokens.bin", vocab=256).train.boundaries) == 0  # without: one document


def test_a_text_folder_trains_packed_documents_with_a_falling_held_out_loss(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = write_text_folder(tmp_path / "text")
    (tmp_path / "packed.par").write_text(PACKED)
    argv = ["--data", str(folder), "--eval-every", "15", "--steps", "30", "--out", str(tmp_path / "r")]
    code = main(["train", str(tmp_path / "packed.par"), *argv])
    _, err = capsys.readouterr()
    assert code == 0, err
    held_out = {r["step"]: r["eval_loss"] for r in rows_of(tmp_path / "r") if "eval_loss" in r}
    assert list(held_out) == [15, 30] and held_out[30] < held_out[15] - 0.3, held_out
