"""A vision transformer's pieces: `flatten` (a grid of patch vectors read row by row as a
sequence), `class_token` (a learned vector before the sequence), `pool` (one vector per
image); their checks; and specs/vit.par trained on the digits dslc ships.

The forward pass is checked against numpy written here from ViT's own definition (Hugging
Face's ViTEmbeddings: a convolution with kernel and stride the patch size, `flatten(2)
.transpose(1, 2)`, the [CLS] vector first, positions added; the head on the [CLS] vector
after the blocks), nothing of dslc's: tolerance 1e-5 relative to the largest logit, f32 (a
few products deep; measured 5.3e-8 pooling the first vector, 6.0e-8 the mean, on 1x1 and 2x2).
Reading the grid of patches column by column instead of row by row moves the mean-pooled
logits by 7.5e-3, 750 times the tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dslc
from dslc.diagnostics import Severity
from tests.conftest import SPECS, compiled

HEADER = "model m\nmesh data=2, model=2\ninput images: f32[8 @ data, 8, 8, 2]\ninput labels: i32[8 @ data]\n"

# One patch layer, the class token, positions, and a head on the pooled vector; the `relu`
# makes the mean depend on which position each patch got, so on the order patches are read in.
TINY = (
    HEADER
    + """forward(images) {
  patches: conv(2, 16, kernel=4, stride=4)
  flatten()
  cls: class_token(16)
  positions: position_embed(5, 16)
  relu()
  pool(mode=MODE)
  head: linear(16, 10)
  loss: cross_entropy(labels)
}
"""
)


def _numpy_logits(w: dict[str, np.ndarray], images: np.ndarray, mode: str, by_columns: bool = False) -> np.ndarray:
    b = images.shape[0]
    # The patches of 4x4 pixels, each a row of its 32 values in the kernel's (height, width,
    # channel) order, in reading order: row of patches by row, left to right.
    order = (0, 3, 1, 2, 4, 5) if by_columns else (0, 1, 3, 2, 4, 5)
    grid = images.reshape(b, 2, 4, 2, 4, 2).transpose(order).reshape(b, 4, 32)
    x = grid @ w["patches.kernel"].reshape(32, 16) + w["patches.bias"]
    x = np.concatenate([np.broadcast_to(w["cls.token"], (b, 1, 16)), x], axis=1)
    x = np.maximum(x + w["positions.table"][:5], 0)
    pooled = x[:, 0] if mode == "first" else x.mean(axis=1)
    return pooled @ w["head.kernel"] + w["head.bias"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x1", "2x2"])
@pytest.mark.parametrize("mode", ["first", "mean"])
def test_a_patch_sequence_with_its_class_token_pools_as_vit_computes_it(mesh: str, mode: str) -> None:
    run = compiled(TINY.replace("MODE", mode), mesh=mesh)
    weights = {k: np.asarray(v, np.float64) for k, v in run.weights.items()}
    want = _numpy_logits(weights, run.batch["images"].astype(np.float64), mode)
    error = np.abs(run.output - want).max() / np.abs(want).max()
    assert error < 1e-5, error


def test_the_pieces_type_and_plan() -> None:
    analysis = dslc.analyze(TINY.replace("MODE", "first"))
    assert analysis.program is not None
    shapes = {layer.path: layer.output.shape for layer in analysis.program.nodes if hasattr(layer, "kind")}
    assert shapes["flatten"] == (8, 4, 16) and shapes["cls"] == (8, 5, 16) and shapes["pool"] == (8, 16)
    weights = {w.name: w.type.shape for layer in analysis.program.nodes for w in getattr(layer, "weights", ())}
    assert weights["token"] == (16,)


def _errors(text: str) -> list[tuple[str, str]]:
    return [(d.code, d.message) for d in dslc.check(text) if d.severity == Severity.ERROR]


def test_a_grid_split_along_its_rows_is_refused() -> None:
    text = TINY.replace("MODE", "first").replace("f32[8 @ data, 8, 8, 2]", "f32[8, 8 @ data, 8, 2]")
    codes = [code for code, _ in _errors(text)]
    assert codes[:1] == ["E029"], codes  # the conv refuses it first


def test_a_sequence_split_over_an_axis_cannot_take_a_class_token_or_pool() -> None:
    text = (
        HEADER.replace("f32[8 @ data, 8, 8, 2]", "f32[8, 16 @ data, 16]")
        + "forward(images) {\n  cls: class_token(16)\n  pool()\n  head: linear(16, 10)\n"
        + "  loss: cross_entropy(labels)\n}\n"
    ).replace("i32[8 @ data]", "i32[8]")
    ((code, message),) = _errors(text)
    assert code == "E029" and "`cls` lengthens the sequence by one" in message


def test_pieces_given_the_wrong_rank_say_what_they_take() -> None:
    text = HEADER.replace("f32[8 @ data, 8, 8, 2]", "f32[8 @ data, 16]") + ("forward(images) {\n  flatten()\n}\n")
    ((code, message),) = _errors(text)
    assert code == "E016" and "[batch, height, width, dim]" in message


@pytest.mark.slow
def test_vit_learns_the_digits_its_held_out_accuracy_rising(tmp_path: Path) -> None:
    from dslc.train.loop import TrainOptions, train

    result = train(dslc.compile(SPECS / "vit.par"), TrainOptions(steps=40, out=tmp_path / "run", eval_every=20))
    accuracy = result.eval_accuracies
    assert sorted(accuracy) == [20, 40], accuracy
    # Ten classes: chance is 10%; after 40 steps of 32 images the held-out digits are mostly
    # right (73% in this seed's run, 44% at step 20).
    assert accuracy[20] > 0.2 and accuracy[40] > 0.6 and accuracy[40] > accuracy[20], accuracy
