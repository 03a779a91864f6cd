"""`dslc train --data` for image classifiers: .npz files, images.npy and labels.npy, folders of
class sub-folders; fitting images to the spec, the held-out split, refusals, and a run.

The images are made here from known pixels. specs/vit.par is shrunk with `--set` to 8x8
one-channel images, one block of width 32 and two classes, batches of 8: its step compiles
in a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dslc.cli import main
from dslc.frontend import analyze
from dslc.ir import nodes as ir
from dslc.train.data import data_notes, dataset_for
from dslc.train.dataset import DataError
from dslc.train.images import ImageBatches
from tests.conftest import SPECS

VIT = str(SPECS / "vit.par")
SMALL = {"side": 8, "patch": 4, "d": 32, "heads": 2, "layers": 1, "classes": 2, "batch": 8}


def vit(**changes: int) -> ir.Program:
    analysis = analyze(VIT, overrides={**SMALL, **changes})
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


def set_flags(**changes: int) -> list[str]:
    return [word for name, value in {**SMALL, **changes}.items() for word in ("--set", f"{name}={value}")]


def images_of(path: Path, **changes: int) -> ImageBatches:
    data = dataset_for(vit(**changes), path)
    assert isinstance(data, ImageBatches)
    return data


def random_images(count: int, shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    """uint8 images all different from one another, so a batch's rows say which they are."""
    return np.random.default_rng(seed).integers(0, 256, (count, *shape), dtype=np.uint8)


def which(rows: np.ndarray, images: np.ndarray) -> list[int]:
    """The index in `images` of each row of a batch."""
    flat = images.reshape(len(images), -1).astype(np.float32) / 255
    return [int(np.flatnonzero((flat == row.reshape(-1)).all(axis=1))[0]) for row in rows]


def write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


# --- reading -------------------------------------------------------------------------------------


def test_an_npz_reaches_the_spec_scaled_to_0_1_with_a_fixed_tenth_held_out(tmp_path: Path) -> None:
    images = random_images(40, (8, 8, 1))
    labels = np.arange(40) % 2
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    data = images_of(tmp_path / "set.npz")
    assert data.description == f"images in {tmp_path / 'set.npz'} (40 as 8x8x1, 2 classes; 4 held out)"
    train, held_out = data.data.train, data.data.held_out
    assert len(held_out) == 4 and sorted([*train, *held_out]) == list(range(40))
    # The same split for every load (and run, and process).
    np.testing.assert_array_equal(images_of(tmp_path / "set.npz").data.held_out, held_out)
    # The first epoch's four full batches of 8: 32 of the 36 training images, none twice, each
    # with its own label and its pixels / 255 exactly.
    batches = [data.batch(0, k) for k in range(4)]
    drawn = [i for b in batches for i in which(b["images"], images)]
    assert len(set(drawn)) == 32 and set(drawn) <= set(train.tolist())
    for b in batches:
        assert b["images"].shape == (8, 8, 8, 1) and b["images"].dtype == np.float32
        np.testing.assert_array_equal(b["images"], images[which(b["images"], images)] / np.float32(255))
        np.testing.assert_array_equal(b["labels"], labels[which(b["images"], images)])
        assert b["labels"].dtype == np.int32
    assert data.held_out is not None
    assert set(which(data.held_out.batch(0, 0)["images"], images)) <= set(held_out.tolist())
    np.testing.assert_array_equal(data.batch(0, 3)["images"], batches[3]["images"])  # the seed and step decide


def test_a_folder_of_images_npy_and_labels_npy_is_the_npz_memory_mapped(tmp_path: Path) -> None:
    images, labels = random_images(30, (8, 8, 1)), np.arange(30) % 2
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    (tmp_path / "pair").mkdir()
    np.save(tmp_path / "pair" / "images.npy", images)
    np.save(tmp_path / "pair" / "labels.npy", labels)
    pair, packed = images_of(tmp_path / "pair"), images_of(tmp_path / "set.npz")
    # uint8 at the spec's size needs no conversion: read from the file a batch at a time.
    assert isinstance(pair.data.pixels, np.memmap) and not pair.data.pixels.flags.writeable
    for step in (0, 5):
        for name in ("images", "labels"):
            np.testing.assert_array_equal(pair.batch(2, step)[name], packed.batch(2, step)[name])


def test_gray_is_repeated_into_every_channel_and_float_pixels_are_kept(tmp_path: Path) -> None:
    gray = np.random.default_rng(2).random((20, 8, 8), dtype=np.float32)  # [N, H, W]: one channel
    np.savez(tmp_path / "gray.npz", images=gray, labels=np.zeros(20, np.int64))
    data = images_of(tmp_path / "gray.npz", channels=3)
    batch = data.batch(0, 0)["images"]
    assert batch.shape == (8, 8, 8, 3)
    for k in range(3):
        np.testing.assert_array_equal(batch[..., k], batch[..., 0])
    for row in batch:  # floats in 0..1 are taken as they are
        assert any(np.array_equal(row[..., 0], g) for g in gray)


def test_rgb_arrays_and_rgb_files_reach_a_gray_spec_alike_cropped_to_its_shape(tmp_path: Path) -> None:
    """The same RGB pixels, 12 rows x 16 columns, as an .npz and as PNG files: converted to
    gray by the same formula (Pillow's) and cropped to the square centre, then resized, alike."""
    rgb = random_images(6, (12, 16, 3), seed=3)
    labels = np.array([0, 0, 0, 1, 1, 1])
    np.savez(tmp_path / "rgb.npz", images=rgb, labels=labels)
    for i, image in enumerate(rgb):
        write_png(tmp_path / "folder" / ("a" if labels[i] == 0 else "b") / f"{i}.png", image)
    arrays, files = images_of(tmp_path / "rgb.npz"), images_of(tmp_path / "folder")
    assert arrays.data.pixels.shape == files.data.pixels.shape == (6, 8, 8, 1)
    np.testing.assert_array_equal(arrays.data.pixels, files.data.pixels)
    np.testing.assert_array_equal(files.data.labels, labels)
    assert "resized from 12x16 to 8x8x1" in arrays.description


def test_an_image_of_another_shape_is_cropped_about_its_centre_not_stretched(tmp_path: Path) -> None:
    wide = np.zeros((8, 16), np.uint8)
    wide[:, :4] = wide[:, 12:] = 255  # white outer quarters: outside the square centre
    tall = np.full((16, 8), 90, np.uint8)
    tall[:4], tall[12:] = 0, 255
    small = np.full((5, 5), 77, np.uint8)  # enlarged: a flat image stays flat
    np.savez(tmp_path / "wide.npz", images=np.stack([wide, wide]) / 255, labels=[0, 1])  # floats resize alike
    for name, image in (("wide", wide), ("tall", tall), ("small", small)):
        write_png(tmp_path / "folder" / name / "0.png", image)
    np.testing.assert_array_equal(images_of(tmp_path / "wide.npz").data.pixels[0, ..., 0], np.zeros((8, 8)))
    fitted = images_of(tmp_path / "folder", classes=3).data.pixels[..., 0]
    np.testing.assert_array_equal(fitted[2], np.zeros((8, 8)))  # classes sorted: small, tall, wide
    np.testing.assert_array_equal(fitted[1], np.full((8, 8), 90))
    np.testing.assert_array_equal(fitted[0], np.full((8, 8), 77))


def test_class_sub_folders_are_labelled_in_name_order_and_the_mapping_is_logged(tmp_path: Path) -> None:
    folder = tmp_path / "pets"
    counts = {"dog": 4, "cat": 2, "bird": 3}  # made in this order; labelled bird 0, cat 1, dog 2
    for level, (name, count) in enumerate(counts.items()):
        for i in range(count):
            where = folder / name / ("nested" if i == 0 else "") / f"{i}.png"
            write_png(where, np.full((8, 8), 50 * (level + 1), np.uint8))
    Image.fromarray(np.full((8, 8), 100, np.uint8)).save(folder / "cat" / "2.jpg", quality=95)
    (folder / "cat" / "notes.txt").write_text("not an image")
    (folder / "dog" / ".DS_Store").write_bytes(b"\0\1")
    data = images_of(folder, classes=3)
    assert data_notes(data) == (
        "classes (label, sub-folder, images): 0 bird (3), 1 cat (3), 2 dog (4)",
        "skipped 1 file without an image extension in the class sub-folders: cat/notes.txt",
    )
    gray = data.data.pixels[:, 0, 0, 0].astype(int)
    np.testing.assert_array_equal(data.data.labels, [0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(gray[[0, 1, 2, 3, 4, 6, 7, 8, 9]], [150, 150, 150, 100, 100, 50, 50, 50, 50])
    assert abs(gray[5] - 100) <= 2  # the JPEG, lossy
    assert data.description == f"images in {folder} (10 in 3 class sub-folders, as 8x8x1; 1 held out)"


# --- refusals ----------------------------------------------------------------------------------------


def unusable(kind: str, root: Path) -> Path:
    """A path that --data must refuse for the small vit (two classes, 8x8x1), of the given kind."""
    gray = np.zeros((8, 8), np.uint8)
    match kind:
        case "empty folder":
            (root / "data").mkdir()
        case "empty class":
            write_png(root / "data" / "cat" / "0.png", gray)
            (root / "data" / "dog").mkdir()
            (root / "data" / "dog" / "readme.txt").write_text("no images yet")
        case "unreadable file":
            write_png(root / "data" / "cat" / "0.png", gray)
            (root / "data" / "dog").mkdir()
            (root / "data" / "dog" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
        case "16-bit file":
            write_png(root / "data" / "cat" / "0.png", gray)
            write_png(root / "data" / "dog" / "0.png", np.zeros((8, 8), np.uint16))
        case "loose images":
            write_png(root / "data" / "0.png", gray)
        case "too many classes":
            for name in ("ant", "bee", "cow"):
                write_png(root / "data" / name / "0.png", gray)
        case "label out of range":
            np.savez(root / "data.npz", images=np.zeros((10, 8, 8)), labels=[0, 1, 1, 0, 2, 1, 0, 2, 0, -1])
            return root / "data.npz"
        case "label count":
            np.savez(root / "data.npz", images=np.zeros((10, 8, 8)), labels=np.zeros(9, np.int32))
            return root / "data.npz"
        case "wrong rank":
            np.savez(root / "data.npz", images=np.zeros((10, 64), np.uint8), labels=np.zeros(10, np.int32))
            return root / "data.npz"
        case "labels of rank 2":
            np.savez(root / "data.npz", images=np.zeros((10, 8, 8), np.uint8), labels=np.zeros((10, 1), np.int32))
            return root / "data.npz"
        case "no images":
            np.savez(root / "data.npz", images=np.zeros((0, 8, 8), np.uint8), labels=np.zeros(0, np.int32))
            return root / "data.npz"
        case "float pixels of 0..255":
            images = np.zeros((10, 8, 8), np.float32)
            images[3, 2, 1] = 255.0
            np.savez(root / "data.npz", images=images, labels=np.zeros(10, np.int32))
            return root / "data.npz"
        case "channels first":
            np.savez(root / "data.npz", images=np.zeros((10, 3, 8, 8), np.uint8), labels=np.zeros(10, np.int32))
            return root / "data.npz"
        case "other names":
            np.savez(root / "data.npz", x_train=np.zeros((10, 8, 8)), y_train=np.zeros(10, np.int32))
            return root / "data.npz"
        case "images.npy alone":
            (root / "data").mkdir()
            np.save(root / "data" / "images.npy", np.zeros((10, 8, 8), np.uint8))
        case "a text file":
            (root / "data.txt").write_text("the cat jumps over the fence\n" * 100)
            return root / "data.txt"
        case "a text folder":
            (root / "data").mkdir()
            (root / "data" / "a.txt").write_text("the cat jumps over the fence\n" * 100)
        case _:
            raise AssertionError(kind)
    return root / "data"


REFUSALS = {
    "empty folder": "it holds no image files (.png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, .tiff, .ppm, .pgm) in class",
    "empty class": "the class sub-folder `dog` holds no image files",
    "unreadable file": "dog/1.png: cannot read it as an image: ",
    "16-bit file": "dog/0.png: its pixels are I;16 (more than 8 bits a channel), which dslc does not scale",
    "loose images": "1 image files (0.png, ...) lie directly in it, with no class sub-folders",
    "too many classes": "3 class sub-folders (ant, bee, cow) but spec `vit` tells 2 classes apart (labels 0 .. 1)",
    "label out of range": "label 2 (image 4) is outside the spec's 2 classes (labels 0 .. 1), as are 2 more",
    "label count": "9 labels for 10 images; each image needs one",
    "wrong rank": "`images` is uint8[10x64]; images are [N, height, width, channels]",
    "labels of rank 2": "`labels` is int32[10x1]; labels are [N] integer class ids (labels.reshape(-1) makes them [N])",
    "no images": "it holds no images",
    "float pixels of 0..255": "image 3 has a pixel of 255.0; float pixels are in 0..1 (divide 0..255 by 255)",
    "channels first": "(channels come last: an array [N, 3, H, W] needs .transpose(0, 2, 3, 1))",
    "other names": "an .npz of images holds arrays named `images` and `labels`; this one holds `x_train`, `y_train`",
    "images.npy alone": "it holds images.npy but no labels.npy",
    "a text file": "spec `vit` classifies images and this is a text or token file; image data are an .npz file",
    "a text folder": "it holds no image files",
}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "message"), REFUSALS.items(), ids=list(REFUSALS))
def test_unusable_images_end_with_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str, message: str
) -> None:
    path = unusable(kind, tmp_path)
    code = main(["train", VIT, *set_flags(), "--data", str(path), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"dslc: error: --data {path}") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npz", "folder"])
def test_an_image_set_given_to_a_language_model_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    if kind == "npz":
        path = tmp_path / "set.npz"
        np.savez(path, images=random_images(4, (8, 8, 1)), labels=[0, 1, 0, 1])
        what = "an .npz file (image data)"
    else:
        path = tmp_path / "set"
        write_png(path / "cat" / "0.png", np.zeros((8, 8), np.uint8))
        what = "a folder of image files"
    code = main(["train", str(SPECS / "tiny.par"), "--data", str(path), "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"dslc: error: --data {path}: {what}, but spec `tiny` is a language model, which reads token files or text\n"
    )


def flat_spec(width: int, loss: str, target: str) -> ir.Program:
    """An MLP over flattened images [4, width], with `target` for `loss`."""
    spec = (
        f"model flat\nmesh data=1\ninput x: f32[4 @ data, {width}]\ninput {target}\n"
        f"forward(x) {{\n  fc: linear({width}, 3)\n  loss: {loss}\n}}\n"
    )
    analysis = analyze(spec)
    assert analysis.program is not None and analysis.ok, analysis.diagnostics
    return analysis.program


def test_a_flat_input_takes_square_gray_images_flattened_and_mse_one_hot_rows(tmp_path: Path) -> None:
    images = random_images(10, (8, 8))
    labels = np.arange(10) % 3
    np.savez(tmp_path / "set.npz", images=images, labels=labels)
    data = dataset_for(flat_spec(64, "mse(y)", "y: f32[4 @ data, 3]"), tmp_path / "set.npz")
    batch = data.batch(0, 0)
    rows = which(batch["x"], images)
    np.testing.assert_array_equal(batch["x"], images[rows].reshape(4, 64) / np.float32(255))
    np.testing.assert_array_equal(batch["y"], np.eye(3, dtype=np.float32)[labels[rows]])
    with pytest.raises(DataError, match=r"a flat input takes one-channel square images side\*side pixels wide"):
        dataset_for(flat_spec(50, "cross_entropy(y)", "y: i32[4 @ data]"), tmp_path / "set.npz")


# --- training --------------------------------------------------------------------------------------


def shades(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy 10x10 RGB images of two classes a model tells apart in a few steps: dark ones
    (pixels 0..99, label 0) and light ones (156..255, label 1)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 2
    images = (rng.integers(0, 100, (count, 10, 10, 3)) + 156 * labels[:, None, None, None]).astype(np.uint8)
    return images, labels


@pytest.mark.slow
def test_a_class_folder_trains_the_small_vit_to_a_falling_held_out_loss_and_high_accuracy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    images, labels = shades(48, seed=4)
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        write_png(tmp_path / "shades" / ("dark" if label == 0 else "light") / f"{i:02d}.png", image)
    run = tmp_path / "run"
    argv = ["--data", str(tmp_path / "shades"), "--eval-every", "20", "--steps", "60", "--out", str(run)]
    code = main(["train", VIT, *set_flags(), *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "classes (label, sub-folder, images): 0 dark (24), 1 light (24)" in err
    assert f"images in {tmp_path / 'shades'} (48 in 2 class sub-folders, as 8x8x1; 5 held out)" in err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = {r["step"]: (r["eval_loss"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r}
    loss = [r["loss"] for r in rows]
    # Seen: held-out loss 0.79, 0.40, 0.001 and accuracy 20%, 100%, 100% at steps 20, 40, 60
    # (five held-out images: a wrong one costs 20%); the training loss from 0.80 to 0.00.
    assert list(held_out) == [20, 40, 60] and held_out[60][1] >= 0.9, held_out
    assert held_out[60][0] < held_out[20][0] / 2, held_out
    assert np.mean(loss[-5:]) < loss[0] - 0.5, loss
    assert "held-out accuracy at step 20: " in out
