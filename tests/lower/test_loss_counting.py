"""A cross-entropy that leaves positions out (Hugging Face's -100 targets, a mask) is the mean
over the positions it counts, over the whole batch: gradient accumulation weighs each slice of
the batch by its count rather than averaging the slices' means, and so does data parallelism
each device's rows (a step in slices sums its gradients over the data axis once, each device
having worked through its own rows).

The pipeline weighs its microbatches alike. Tolerances: f32 throughout, 3e-5 relative as in
test_numerics (reordered f32 sums; measured here: loss 1e-7, worst gradient 6e-7).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dslc
from tests import reference
from tests.conftest import TEST_SPECS
from tests.tolerances import assert_grads_close, relative_error

SPEC = (TEST_SPECS / "counted.par").read_text()
TOLERANCE = 3e-5
# Where most targets are ignored: in slice 0 of the accumulation (the even rows, on both
# data shards), or on the first data shard (rows 0-3): its devices count far fewer positions.
IGNORED = {"first_slice": np.s_[0::2, :6], "first_data_shard": np.s_[:4, :6]}


@pytest.fixture(scope="module")
def compiled() -> tuple[Any, Any, dict[str, np.ndarray], dict[str, np.ndarray]]:
    program = dslc.compile(SPEC)
    model = program.init(0)
    batch = program.example_batch(0)
    batch["targets"][IGNORED["first_slice"]] = -100
    return program, model, program.export_weights(model), batch


@pytest.mark.parametrize("where", sorted(IGNORED))
def test_accumulated_loss_and_grads_are_the_whole_batch_mean_over_counted_targets(
    compiled: tuple[Any, Any, dict[str, np.ndarray], dict[str, np.ndarray]], where: str
) -> None:
    program, model, weights, batch = compiled
    batch = {**batch, "targets": program.example_batch(0)["targets"]}
    batch["targets"][IGNORED[where]] = -100
    want = reference.evaluate(program.ir, weights, batch)
    loss, grads = program.loss_and_grads(model, batch)
    assert want.loss is not None and relative_error(loss, want.loss) <= TOLERANCE
    assert_grads_close(grads, want.grads, TOLERANCE)
    # The mean of the two parts' means is another number: the test can tell them apart.
    parts = np.s_[0::2], np.s_[1::2]
    if where == "first_data_shard":
        parts = np.s_[:4], np.s_[4:]
    halves = [reference.evaluate(program.ir, weights, {k: v[part] for k, v in batch.items()}) for part in parts]
    mean_of_means = (halves[0].loss + halves[1].loss) / 2  # type: ignore[operator]
    assert relative_error(mean_of_means, want.loss) > 30 * TOLERANCE


def test_ignored_targets_are_not_counted(
    compiled: tuple[Any, Any, dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    program, model, _, batch = compiled
    counted = batch["targets"] != -100
    logits = np.asarray(program.forward(model, batch), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(shifted, np.where(counted, batch["targets"], 0)[..., None], -1)[..., 0]
    nll = np.log(np.exp(shifted).sum(-1)) - picked
    assert float(program.loss(model, batch)) == pytest.approx(nll[counted].mean(), rel=TOLERANCE)
    assert abs(nll[counted].mean() - nll.mean()) > 1e-3  # counting every position would show
    nothing = {**batch, "targets": np.full_like(batch["targets"], -100)}
    assert float(program.loss(model, nothing)) == 0.0
    assert all(not np.any(g) for g in program.grads(model, nothing).values())


PIPELINED = (TEST_SPECS / "counted_pipeline.par").read_text()


@pytest.fixture(scope="module")
def pipelined() -> Any:
    program = dslc.compile(PIPELINED)
    assert program.ir.pipelined
    return program, program.init(0)


@pytest.mark.parametrize("where", sorted(IGNORED))
def test_pipeline_microbatches_weigh_by_their_counted_targets(pipelined: Any, where: str) -> None:
    # Microbatch 0 takes the even rows, most of whose targets are ignored (or the first data
    # shard's devices count fewer): the pipeline's loss and gradients are still the whole
    # batch's mean over counted targets.
    program, model = pipelined
    batch = program.example_batch(0)
    batch["targets"][IGNORED[where]] = -100
    weights = program.export_weights(model)
    want = reference.evaluate(program.ir, weights, batch)
    loss, _ = program.value_and_grad(model, batch)
    assert want.loss is not None and relative_error(loss, want.loss) <= TOLERANCE
    assert_grads_close(program.grads(model, batch), want.grads, TOLERANCE)
