"""`dslc train`: embedded data, metrics, the loss curve, checkpoints and resuming.

The training tests run specs/tiny.par (about 220k parameters) for a handful of steps on
its 4-device mesh; each run costs a compilation of 2-4 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dslc.cli import main
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.train.checkpoint import PAUSE_ENV
from dslc.train.data import data_warnings, dataset_for
from dslc.train.dataset import DataError
from dslc.train.digits import load_digits, resample
from dslc.train.plot import BOTTOM, HEIGHT, LEFT, TOP, WIDTH, loss_curve_png
from dslc.train.tokens import NextTokens, in_memory
from tests.conftest import ROOT, SPECS

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

TINY = str(SPECS / "tiny.par")
TINY_TEXT = (SPECS / "tiny.par").read_text()


def checked(source: str | Path) -> ir.Program:
    analysis = analyze(source)
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one row per step, in order"
    return {r["step"]: r["loss"] for r in rows}


def decode_png(data: bytes) -> np.ndarray:
    """The RGB pixels of a PNG as written by dslc.train.plot (one IDAT, filter 0 lines)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length : at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + 3 * width)
    assert not raw[:, 0].any()
    return raw[:, 1:].reshape(height, width, 3)


# --- data ---------------------------------------------------------------------------------


def test_corpus_batches_depend_only_on_seed_and_step() -> None:
    data = dataset_for(checked(TINY))
    first = data.batch(0, 5)
    assert set(first) == {"tokens", "targets"}
    assert first["tokens"].shape == (8, 32) and first["tokens"].dtype == np.int32
    np.testing.assert_array_equal(first["tokens"], data.batch(0, 5)["tokens"])
    assert not np.array_equal(first["tokens"], data.batch(0, 6)["tokens"])
    assert not np.array_equal(first["tokens"], data.batch(1, 5)["tokens"])
    # Targets are the next byte of each token.
    np.testing.assert_array_equal(first["targets"][:, :-1], first["tokens"][:, 1:])
    assert data.unit == "tokens" and data.per_batch == 8 * 32


def test_corpus_maps_bytes_beyond_a_small_vocabulary_to_its_last_id() -> None:
    program = checked(SPECS / "gpt_small.par")  # vocab 128: ASCII
    assert dataset_for(program).batch(0, 0)["tokens"].max() <= 127
    tokens, targets = program.input("tokens"), program.input("targets")
    text = bytes([65, 126, 127, 128, 200, 255]) * 20
    ids = NextTokens(in_memory(text), 128, tokens, targets, "bytes", "").batch(0, 0)["tokens"]
    assert set(np.unique(ids)) <= {65, 126, 127}


def test_language_model_with_too_few_ids_is_refused() -> None:
    with pytest.raises(DataError, match="at least 128"):
        dataset_for(checked(_lm_spec(vocab=64)))


def test_bidirectional_attention_on_next_token_targets_is_warned_about() -> None:
    # Seen: such a model (rope, causal=false) trained to a loss of 0.145 by reading the answer.
    assert data_warnings(checked(TINY)) == []
    bidirectional = TINY_TEXT.replace("attention(d, heads)", "attention(d, heads, causal=false, rope=true)")
    (warning,) = data_warnings(checked(bidirectional))
    assert warning.startswith("warning: `layers.attn` attends both ways (causal=false)")
    assert "causal=true" in warning
    assert data_warnings(checked(SPECS / "seed_mlp_pipeline.par")) == []


def test_digits_feed_the_mlp_spec_as_28x28_images_without_repeats_in_an_epoch() -> None:
    data = dataset_for(checked(SPECS / "seed_mlp_pipeline.par"))
    batch = data.batch(0, 0)
    assert batch["images"].shape == (32, 784) and batch["images"].dtype == np.float32
    assert batch["images"].min() >= 0.0 and batch["images"].max() <= 1.0
    assert batch["labels"].shape == (32,) and set(np.unique(batch["labels"])) <= set(range(10))
    # 1500 training images (297 held out): the first 46 batches of 32 are 1472 distinct images.
    seen = np.concatenate([data.batch(0, k)["images"] for k in range(46)])
    assert len(np.unique(seen, axis=0)) == len(seen)


def test_digit_resampling_to_the_native_size_is_the_identity() -> None:
    digits = load_digits()
    assert digits.images.shape == (1797, 8, 8) and len(digits.labels) == 1797
    np.testing.assert_allclose(resample(digits.images[:5], 8), digits.images[:5], atol=1e-6)


def test_digits_as_mse_targets_are_one_hot_rows() -> None:
    data = dataset_for(checked(_mlp_spec(width=64, loss="mse(y)", target="y: f32[16, 10]")))
    batch = data.batch(3, 2)
    np.testing.assert_array_equal(batch["y"].sum(axis=1), np.ones(16))


def test_image_width_that_is_not_square_says_what_would_fit() -> None:
    with pytest.raises(DataError, match=r"side\*side pixels wide \(e\.g\. 64 .* 784"):
        dataset_for(checked(_mlp_spec(width=50, loss="cross_entropy(y)", target="y: i32[16]")))


def test_spec_with_inputs_no_data_set_fits_is_refused_with_what_each_needs() -> None:
    with pytest.raises(DataError) as caught:
        dataset_for(checked(SPECS / "seed_tp_layer.par"))
    message = str(caught.value)
    assert "`x`: f32[2@data, 128, 768]" in message
    assert "byte-level language model" in message and "digit classifier" in message


def _lm_spec(vocab: int) -> str:
    return f"""model lm
mesh data=1
input tokens: i32[4 @ data, 8]
input targets: i32[4 @ data, 8]
forward(tokens) {{
  embed: embed({vocab}, 16)
  head: linear(16, {vocab})
  loss: cross_entropy(targets)
}}
"""


def _mlp_spec(width: int, loss: str, target: str) -> str:
    return f"""model mlp
mesh data=1
input x: f32[16 @ data, {width}]
input {target.replace("[16", "[16 @ data")}
forward(x) {{
  fc1: linear({width}, 32)
  relu()
  fc2: linear(32, 10)
  loss: {loss}
}}
"""


# --- the loss curve -------------------------------------------------------------------------


def test_loss_curve_is_a_png_with_the_curve_falling_left_to_right() -> None:
    steps = list(range(1, 51))
    image = decode_png(loss_curve_png(steps, [5.0 * 0.95**s for s in steps]))
    assert image.shape == (HEIGHT, WIDTH, 3)
    curve = np.argwhere(np.all(image == (24, 90, 170), axis=-1))  # the smoothed line's colour
    assert len(curve) > 100
    left, right = curve[curve[:, 1] < WIDTH // 4], curve[curve[:, 1] > 3 * WIDTH // 4]
    assert left[:, 0].mean() < right[:, 0].mean()  # rows grow downwards: high loss on the left


def test_loss_curve_has_axis_titles_a_legend_and_a_smoothed_line_that_starts_with_the_data() -> None:
    steps = list(range(1, 201))
    noise = np.random.default_rng(0).standard_normal(200) * 0.2
    raw = [3.0 + 3.0 * 0.98**s + n for s, n in zip(steps, noise, strict=True)]
    image = decode_png(loss_curve_png(steps, raw, [(100, 3.5), (200, 3.2)]))
    smoothed, held_out = np.all(image == (24, 90, 170), axis=-1), np.all(image == (222, 110, 20), axis=-1)
    text = np.all(image == (90, 90, 90), axis=-1)
    # The legend (the three colours, and their names) sits in the top margin, above the plot.
    assert smoothed[:TOP].any() and held_out[:TOP].any() and text[:TOP, WIDTH // 2 :].any()
    assert text[HEIGHT - BOTTOM + 4 :, WIDTH // 3 : 2 * WIDTH // 3].any(), "the step axis's title"
    # The first point of the smoothed line is the first loss itself: the top of the plot
    # area is the highest value, and the first loss (6.0 + noise) is near it.
    first = np.flatnonzero(smoothed[TOP:, LEFT])
    highest = max(*raw, 3.5)
    expected = (highest - raw[0]) / (highest - min(raw)) * (HEIGHT - BOTTOM - 1 - TOP)
    assert first.size and abs(first[0] - expected) <= 2, (first[:3], expected)
    assert held_out[TOP:].sum() > 50, "held-out points and the line between them"


def test_loss_curve_of_one_step_or_none_still_encodes() -> None:
    assert decode_png(loss_curve_png([], [])).shape == (HEIGHT, WIDTH, 3)
    assert decode_png(loss_curve_png([7], [float("nan")])).shape == (HEIGHT, WIDTH, 3)
    assert decode_png(loss_curve_png([7], [2.0])).shape == (HEIGHT, WIDTH, 3)


# --- training -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Six steps of tiny on its 2x2 mesh in one go: the trajectory resumed runs must follow."""
    run = tmp_path_factory.mktemp("uninterrupted")
    assert main(["train", TINY, "--steps", "6", "--out", str(run)]) == 0
    return losses(run)


def test_loss_falls_over_30_steps_and_metrics_are_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The embedded default spec, evaluated on the held-out tail of its corpus every 10 steps.
    code, out, err = train(capsys, "--steps", "30", "--eval-every", "10", "--out", str(tmp_path))
    assert code == 0, err
    curve = losses(tmp_path)
    assert len(curve) == 30
    # Seen on this machine: the mean of the first three losses 5.95, of the last three 3.30
    # (ln 256 = 5.55 is a uniform guess). Half of that drop is a safe bar.
    before, after = np.mean([curve[s] for s in (1, 2, 3)]), np.mean([curve[s] for s in (28, 29, 30)])
    assert before - after > 1.3, (before, after)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]) == {
        "step",
        "loss",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "lr",
        "compiled",
        "eval_loss",
        "eval_accuracy",
    } | {
        "model_flops",
        "tflops_per_device",
        "mfu",
        "peak_tflops",
    }
    assert rows[-1]["lr"] == pytest.approx(3e-3) and not rows[-1]["compiled"]
    # The next byte's accuracy: a share, above chance (1 of 256) once the loss has fallen.
    assert 1 / 256 < rows[-1]["eval_accuracy"] <= 1
    assert all(r["grad_norm"] > 0 for r in rows)
    # Seen: 4.37, 3.42, 3.00 held out at steps 10, 20, 30.
    held_out = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert list(held_out) == [10, 20, 30] and held_out[30] < held_out[10] - 0.7, held_out
    assert "step 1: compiling the training step" in err and "compiled and ran in" in err
    assert "step 20: held-out loss " in err
    assert "loss 5.9641 -> " in out and "held-out loss at step 10: " in out and "steady state over 29 steps" in out
    assert decode_png((tmp_path / "loss.png").read_bytes()).shape == (HEIGHT, WIDTH, 3)


def test_digit_classifier_trains_through_its_pipeline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = train(capsys, str(SPECS / "seed_mlp_pipeline.par"), "--steps", "20", "--out", str(tmp_path))
    assert code == 0, err
    curve = losses(tmp_path)
    # Seen: 2.30 at step 1 (ln 10, chance) and below 1.5 by step 20.
    assert curve[1] > 2.0 and np.mean([curve[s] for s in (18, 19, 20)]) < curve[1] - 0.5
    assert "samples/s" in out


def test_resume_follows_the_uninterrupted_trajectory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    assert train(capsys, TINY, "--steps", "3", "--out", str(tmp_path))[0] == 0
    code, _, err = train(capsys, TINY, "--steps", "6", "--resume", "--out", str(tmp_path))
    assert code == 0
    assert "resumed from the checkpoint at step 3" in err
    # Bitwise: the same program on the same mesh, restored from an exact f32 copy, with
    # batches and dropout keys that depend only on the seed and the step.
    assert losses(tmp_path) == uninterrupted
    code, out, _ = train(capsys, TINY, "--steps", "6", "--resume", "--out", str(tmp_path))
    assert code == 0 and "nothing to do" in out


def test_resume_onto_another_mesh_reshards(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    assert train(capsys, TINY, "--mesh", "2x2", "--steps", "3", "--out", str(tmp_path))[0] == 0
    code, out, err = train(capsys, TINY, "--mesh", "4x1", "--steps", "6", "--resume", "--out", str(tmp_path))
    assert code == 0
    assert "resharded from mesh 2x2 (data, model)" in err and "on mesh 4x1" in out
    # Another mesh sums partial results in another order: f32 rounding, seen at 9e-8
    # relative after three Adam steps. 1e-5 is loose for that and far below a wrong restore
    # (a fresh model would start again at 6.08).
    resumed = losses(tmp_path)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5)


def test_a_pipelined_checkpoint_restores_on_other_stage_counts_with_identical_weights(tmp_path: Path) -> None:
    # Saved on 2x2x2 (data x model x pipeline), restored where the pipeline has 4 stages and
    # where it has none: every stored array keeps its name and whole shape on every mesh, and
    # only how it is split changes, so the restore is exact, optimizer state included.
    import jax

    import dslc
    from dslc.train.checkpoint import Checkpoints, run_state

    overrides = {"layers": 4, "seq": 16, "hidden": 64, "heads": 4, "batch": 32}
    spec = SPECS / "seed_hybrid_3d.par"
    saved = dslc.compile(spec, mesh="2x2x2", overrides=overrides)
    model = saved.init(0)
    # A non-trivial optimizer state: moments of 0 would restore equal by accident.
    opt_state = jax.tree.map(
        lambda x: x + 0.25 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, saved.init_optimizer(model)
    )
    fields = {"seed": 0, "data_position": 0, "data": "", "data_fingerprint": "", "spec": "seed_hybrid_3d"}
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(model, opt_state, run_state(model, opt_state, step=1, mesh="2x2x2", **fields))
    want_weights = saved.export_weights(model)
    want_state = [np.asarray(leaf) for leaf in jax.tree.leaves(opt_state)]
    for mesh in ("2x1x4", "4x2x1"):
        other = dslc.compile(spec, mesh=mesh, overrides=overrides)
        fresh = other.init(1)
        restored_state = checkpoints.restore(1, fresh, other.init_optimizer(fresh))
        got = other.export_weights(fresh)
        assert set(got) == set(want_weights)
        for name, value in want_weights.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} on {mesh}")
        for got_leaf, want_leaf in zip(jax.tree.leaves(restored_state), want_state, strict=True):
            np.testing.assert_array_equal(np.asarray(got_leaf), want_leaf)
    checkpoints.close()


def test_kill_during_a_save_leaves_the_previous_checkpoint_usable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    run, marker, log = tmp_path / "run", tmp_path / "paused", tmp_path / "log"
    env = {**os.environ, PAUSE_ENV: f"3:{marker}"}
    command = [sys.executable, "-m", "dslc.cli", "train", TINY, "--steps", "10", "--checkpoint-every", "1"]
    with log.open("w") as output:
        child = subprocess.Popen([*command, "--out", str(run)], cwd=ROOT, env=env, stdout=output, stderr=output)
        try:
            deadline = time.monotonic() + 180
            while not marker.exists():
                assert child.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the save never reached the pause"
                time.sleep(0.1)
            partial = Path(marker.read_text()).parent  # the temporary directory of checkpoint 3
            assert partial.is_dir() and partial.name.startswith("3.")
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", partial.name]

    code, _, err = train(capsys, TINY, "--steps", "4", "--resume", "--out", str(run))
    assert code == 0
    assert "resumed from the checkpoint at step 2" in err
    assert losses(run) == {s: uninterrupted[s] for s in (1, 2, 3, 4)}
    assert not partial.exists()  # orbax cleans up the unfinished save


@pytest.mark.sample(1)
@pytest.mark.parametrize("paused", [3, 1])
def test_a_second_ctrl_c_during_a_save_says_what_was_kept_and_removes_the_unfinished_save(
    tmp_path: Path, paused: int
) -> None:
    # The first Ctrl-C lands while checkpoint `paused` is half-written (the test hook holds
    # the save there), the second stops the run inside that save.
    run, marker, log = tmp_path / "run", tmp_path / "paused", tmp_path / "log"
    env = {**os.environ, PAUSE_ENV: f"{paused}:{marker}"}
    command = [sys.executable, "-m", "dslc.cli", "train", TINY, "--steps", "10", "--checkpoint-every", "1"]
    with log.open("w") as stderr:
        child = subprocess.Popen(
            [*command, "--out", str(run)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        try:
            deadline = time.monotonic() + 180
            while not marker.exists():
                assert child.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the save never reached the pause"
                time.sleep(0.1)
            partial = Path(marker.read_text()).parent  # the temporary directory of the paused checkpoint
            assert partial.is_dir() and ".orbax-checkpoint-tmp" in partial.name
            os.kill(child.pid, signal.SIGINT)
            while "Ctrl-C: stopping after this step; again to stop now" not in log.read_text():
                assert child.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            os.kill(child.pid, signal.SIGINT)
            out, _ = child.communicate(timeout=120)
        finally:
            child.kill()
            child.wait()
    err = log.read_text()
    assert child.returncode == 130, err
    assert out == "" and "Traceback" not in err
    assert not partial.exists(), "the half-written checkpoint is removed"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(s) for s in range(1, paused)]
    last = err.splitlines()[-1]
    if paused > 1:
        assert last == (
            f"stopped without saving; the run can resume from its checkpoint at step {paused - 1} "
            f"in {run / 'checkpoints'} (the same command with --resume)"
        )
    else:
        assert last == "stopped without saving; no checkpoint was kept (train again without --resume)"


def test_an_unfinished_save_whose_writes_go_on_is_left_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Removing a temporary directory while an interrupted save still writes into it would
    # see the writes recreate parts of it: it is left, and said where.
    from dslc.train import checkpoint
    from dslc.train.loop import _stopped_at_once

    monkeypatch.setattr(checkpoint, "WRITES_END_S", 0.2)
    checkpoints = checkpoint.Checkpoints(tmp_path)
    checkpoints.close()
    partial = tmp_path / "4.orbax-checkpoint-tmp"
    partial.mkdir()
    done = threading.Event()
    writer = threading.Thread(target=done.wait)
    writer.start()
    checkpoints._writers = [writer]
    try:
        said = _stopped_at_once(checkpoints, 3)
    finally:
        done.set()
        writer.join()
    assert partial.is_dir()
    assert said.splitlines()[1] == (
        f"{partial} is a checkpoint that was still being written (not used to resume); "
        "the next run in this folder removes it"
    )
    assert checkpoints.discard_unfinished() == [] and not partial.exists()  # once the writes have ended


# --- bad input ----------------------------------------------------------------------------


def test_missing_spec_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = train(capsys, str(tmp_path / "nope.par"), "--steps", "1", "--out", str(tmp_path))
    assert code == 2 and "no such file" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("--mesh", "2x"),
        ("--steps", "0"),
        ("--seed", "-1"),
        ("--profile", "3:2"),
        ("--profile", "0:2"),
        ("--profile", "1:2:3"),
        ("--device-flops", "0"),
        ("--device-flops", "nan"),
    ],
)
def test_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...]) -> None:
    code, _, err = train(capsys, TINY, "--steps", "1", "--out", str(tmp_path), *argv)  # the last --steps wins
    assert code == 2 and err


def test_mesh_the_spec_cannot_use_reports_its_diagnostics(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = train(capsys, TINY, "--mesh", "3x1", "--steps", "1", "--out", str(tmp_path))
    assert code == 1 and "error[" in err


def test_spec_without_embedded_data_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = train(capsys, str(SPECS / "seed_tp_layer.par"), "--steps", "1", "--out", str(tmp_path))
    assert code == 2 and "no embedded data for spec `seed_tp_layer`" in err
    assert not any(tmp_path.iterdir()), "nothing written for a refused spec"


def test_out_that_cannot_be_a_folder_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = train(capsys, TINY, "--steps", "1", "--out", str(blocker / "run"))
    assert code == 2 and f"cannot use {blocker / 'run'} as the run folder" in err


def test_resume_without_a_checkpoint_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = train(capsys, TINY, "--steps", "2", "--resume", "--out", str(tmp_path))
    assert code == 2 and "no checkpoint" in err and "without --resume" in err


def test_refused_resume_prints_one_line_and_creates_nothing(tmp_path: Path) -> None:
    # In a fresh process, so that what runs at interpreter shutdown is seen: orbax's
    # clean-up thread used to end such a run with a traceback. Nothing to resume: no run
    # folder at all, and a `checkpoints/` holding only an unfinished save (killed while
    # writing the first one), which the refused run still cleans up.
    unfinished = tmp_path / "killed" / "checkpoints" / "1.orbax-checkpoint-tmp-1700000000000000"
    unfinished.mkdir(parents=True)
    for run in (tmp_path / "never", tmp_path / "killed"):
        command = [sys.executable, "-m", "dslc.cli", "train", TINY, "--steps", "2", "--resume", "--out", str(run)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"dslc: error: no checkpoint in {run / 'checkpoints'} to resume from; train without --resume first"
        ]
    assert not (tmp_path / "never").exists()
    assert not unfinished.exists()


def test_checkpoints_of_another_spec_or_an_existing_run_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert train(capsys, TINY, "--steps", "1", "--out", str(tmp_path))[0] == 0
    code, _, err = train(capsys, TINY, "--set", "d=32", "--steps", "2", "--resume", "--out", str(tmp_path))
    assert code == 2 and "not of this spec" in err and "`embed.table` is (256, 64) there, (256, 32) here" in err
    code, _, err = train(capsys, TINY, "--steps", "2", "--out", str(tmp_path))
    assert code == 2 and "already holds a checkpoint at step 1" in err and "--resume" in err
    code, _, err = train(capsys, TINY, "--steps", "2", "--resume", "--seed", "5", "--out", str(tmp_path))
    assert code == 2 and "seed 0, not 5" in err
    (tmp_path / "checkpoints" / "1" / "run" / "metadata").write_text('{"step": 1}')  # not dslc's
    code, _, err = train(capsys, TINY, "--steps", "2", "--resume", "--out", str(tmp_path))
    assert code == 2 and "cannot read the checkpoint at step 1" in err


def test_the_default_run_folder_never_reuses_an_earlier_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's main command, run twice: the second run gets its own folder, and
    # `--resume` continues the newest one.
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "2"]) == 0
    assert main(["train", "--steps", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny", "tiny-2"]
    assert main(["train", "--steps", "3", "--resume"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny-2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 3
    assert len((tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()) == 2


# ---- preemption: SIGTERM, and one command for every restart ----------------------------------


def test_one_command_survives_sigkill_and_sigterm_and_ends_on_the_uninterrupted_loss(
    tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    """A preemptible job's script runs the same line at every (re)start. The first start is
    killed (SIGKILL) inside the save of checkpoint 2; the second resumes from checkpoint 1 and
    is preempted (SIGTERM, what Slurm, Kubernetes and the clouds send first) inside the save
    of checkpoint 4, which it finishes before it stops; the third completes the run."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dslc.cli", "train", TINY, "--steps", "6", "--checkpoint-every", "1"]
    command += ["--auto-resume", "--out", str(run)]

    def start(paused: int, name: str) -> tuple[subprocess.Popen[str], Path, Path]:
        marker, log = tmp_path / f"{name}.paused", tmp_path / f"{name}.log"
        env = {**os.environ, PAUSE_ENV: f"{paused}:{marker}"}
        with log.open("w") as stderr:
            child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        return child, marker, log

    child, _, log = start(2, "first")
    try:
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL and "resumed" not in log.read_text()

    child, marker, log = start(4, "second")
    try:
        os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while "SIGTERM: stopping after this step" not in log.read_text():
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        marker.unlink()  # the save goes on, and the run stops after it
        out, _ = child.communicate(timeout=120)
    finally:
        child.kill()
    err = log.read_text()
    assert child.returncode == 143 and "Traceback" not in err, err  # 128 + SIGTERM, as a shell reports it
    assert "resumed from the checkpoint at step 1" in err
    again = ["dslc", "train", TINY, "--checkpoint-every", "1", "--steps", "6", "--out", str(run), "--auto-resume"]
    assert out == f"stopped at step 4, checkpoint saved; to continue:\n  {shlex.join(again)}\n"
    assert (run / "checkpoints" / "4").is_dir()

    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert "resumed from the checkpoint at step 4" in finished.stderr
    # Bitwise, as any resume on the same mesh: batches and dropout depend only on seed and step.
    assert losses(run) == uninterrupted


# ---- what a run reports: MFU, profiles, dashboards ------------------------------------------


@dataclass(frozen=True)
class Observed:
    """Two runs into one folder: steps 1-4 (checkpoints 2 and 4, evaluations at 2 and 4,
    `--profile 2:3`, no peak for MFU), then, as if killed before checkpoint 4, a resume from
    checkpoint 2 to step 6 with `--device-flops 0.5`."""

    run: Path
    outputs: tuple[tuple[str, str], tuple[str, str]]  # (stdout, stderr) of each


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    import contextlib
    import io

    run = tmp_path_factory.mktemp("observed")
    every = ("--eval-every", "2", "--checkpoint-every", "2", "--out", str(run))
    outputs = []
    for argv in (
        ("--steps", "4", "--profile", "2:3", *every),
        ("--steps", "6", "--profile", "2:2", "--device-flops", "0.5", "--resume", *every),
    ):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["train", TINY, *argv]) == 0, err.getvalue()
        outputs.append((out.getvalue(), err.getvalue()))
        if len(outputs) == 1:
            shutil.rmtree(run / "checkpoints" / "4")  # the first run's last: it "never finished"
    return Observed(run, (outputs[0], outputs[1]))


def observed_rows(observed: Observed) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (observed.run / "metrics.jsonl").read_text().splitlines()]


def test_each_row_carries_model_flops_tflops_per_device_and_mfu_against_the_peak_used(observed: Observed) -> None:
    import dslc
    from dslc.plan.flops import flops

    (first, _), (second, _) = observed.outputs
    assert "MFU not reported: no published peak for cpu (--device-flops T gives one)" in first
    assert "of 0.5 TFLOP/s per device, from --device-flops" in second
    counted = flops(dslc.compile(TINY).ir)
    rows = observed_rows(observed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        peak = None if r["step"] <= 2 else 0.5  # steps 1-2 are the first run's
        assert r["model_flops"] == counted.forward + counted.backward
        # tiny's mesh has 4 devices
        assert r["tflops_per_device"] == pytest.approx(r["model_flops"] / r["step_time_s"] / 4 / 1e12, rel=1e-9)
        assert r["peak_tflops"] == peak
        assert r["mfu"] == (None if peak is None else pytest.approx(r["tflops_per_device"] / peak, rel=1e-9))


@pytest.mark.sample(1)
@pytest.mark.parametrize("name", ["tiny", "llama_small"])
def test_the_planners_flops_match_the_compiled_steps_matrix_products(name: str) -> None:
    """An independent count: every matrix product of the traced gradient step (each scan
    body as many times as it runs), against the planner's forward, backward and
    recomputation. The trace counts products only, the planner elementwise work too; seen:
    0.953 (tiny) and 1.024 (llama_small, `checkpoint full`: its recomputation in both)."""
    import dslc
    from dslc.plan.flops import flops
    from tests.jaxpr_flops import dot_flops

    program = dslc.compile(SPECS / f"{name}.par")
    assert flops(program.ir).model == pytest.approx(dot_flops(program.trace("grads").jaxpr), rel=0.1)


def test_profile_traces_exactly_the_steps_asked_for(observed: Observed) -> None:
    import gzip

    profile = observed.run / "profile"
    (_, first), (_, second) = observed.outputs
    traces = list((profile / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
    assert len(traces) == 1 and list(traces[0].parent.glob("*.xplane.pb")), "Perfetto's and TensorBoard's files"
    assert f"profile of steps 2-3 in {profile}: tensorboard --logdir {profile}" in first
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    # Steps 2 and 3 ran inside the trace, on each of tiny's 4 devices; steps 1 and 4 did not.
    executions = [e for e in events if e.get("name", "").endswith("Execute (jit_step)")]
    assert sorted(e["name"][:3] for e in executions if e["name"].startswith("[")) == sorted(
        f"[{d}]" for d in range(4) for _ in range(2)
    )
    assert "--profile 2:2: no step of it runs here (steps 3-6), nothing traced" in second


def board_scalars(run: Path) -> dict[str, dict[int, float]]:
    """TensorBoard's own reading of the run's event files: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    board = EventMultiplexer().AddRunsFromDirectory(str(run / "tensorboard")).Reload()
    found: dict[str, dict[int, float]] = {}
    for name in board.Runs():
        for tag in board.Runs()[name]["scalars"]:
            events = board.Scalars(name, tag)
            steps = [e.step for e in events]
            assert len(steps) == len(set(steps)), f"{tag}: steps logged twice {steps}"
            found.setdefault(tag, {}).update({e.step: e.value for e in events})
    return found


def test_every_logged_scalar_is_in_tensorboards_event_files_once_per_step(observed: Observed) -> None:
    # The resumed run logged steps 3 and 4 again, and its event file purges the first run's.
    assert len(list((observed.run / "tensorboard").iterdir())) == 2
    rows = observed_rows(observed)
    scalars = board_scalars(observed.run)
    numbers = {k for r in rows for k, v in r.items() if isinstance(v, float | int) and not isinstance(v, bool)}
    assert set(scalars) == numbers - {"step"} and {"eval_loss", "mfu"} <= set(scalars)
    for tag, by_step in scalars.items():
        want = {r["step"]: r[tag] for r in rows if r.get(tag) is not None}
        assert sorted(by_step) == sorted(want), tag
        for step, value in by_step.items():  # event files keep 32-bit floats
            assert value == pytest.approx(want[step], rel=1e-6), (tag, step)


def test_wandb_without_its_package_is_a_usage_error_before_anything_is_made(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, _, err = train(capsys, TINY, "--steps", "2", "--wandb", "--out", str(tmp_path / "run"))
    assert code == 2 and "--wandb needs the wandb package: pip install wandb" in err
    assert not (tmp_path / "run").exists()


def test_wandb_gets_the_same_scalars_in_one_run_per_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a stand-in for the wandb package: the calls dslc makes of it, as documented."""
    import importlib.machinery
    import types

    calls: list[tuple[str, Any]] = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    run = types.SimpleNamespace(
        log=lambda values, step: calls.append(("log", (step, values))), finish=lambda: calls.append(("finish", None))
    )
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert train(capsys, TINY, "--steps", "3", "--wandb", "--out", str(tmp_path / "run"))[0] == 0
    (kind, init), *logs, (last, _) = calls
    assert kind == "init" and last == "finish"
    assert init["project"] == "dslc" and init["name"] == "run" and init["resume"] == "allow"
    assert init["config"]["spec"] == "tiny" and init["dir"] == str(tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [step for _, (step, _) in logs] == [1, 2, 3]
    for (_, (_, values)), row in zip(logs, rows, strict=True):
        assert values["loss"] == row["loss"] and values["tflops_per_device"] == row["tflops_per_device"]
        assert "compiled" not in values and "mfu" not in values
