"""The same numbers under every layout: for each spec at test size (tests/layouts.py), every
ZeRO stage and FSDP, with and without accumulation, under the spec's pipeline schedule and
every other one, on two meshes that split every axis, the loss and every gradient equal the
single-device reference, and (on the first mesh) one training step reports the reference's
loss and gradient norm. A combination `dslc check` refuses is skipped with its error codes.

The suite checks a seeded sample of the space (and, in test_moe_under_zero.py, the mixtures of
experts a user found wrong under ZeRO): one combination from each of `SAMPLE` specs, drawn anew each day (the seed is in
the run's header line; `DSLC_SAMPLE_SEED=N` repeats a draw). The whole space:

    python -m pytest tests/lower/test_layouts.py --layouts all --dist load

(`--layouts ID,ID` runs the combinations named.) Tolerances are the numerics tests'
(tests/tolerances.py): f32 3e-5, bf16 1e-1 on gradients; a layout mistake (a sum missed or
made twice, a piece in the wrong place) is of the order of the gradient itself.
"""

from __future__ import annotations

import pytest

from tests import layouts
from tests.conftest import sample_seed
from tests.layouts import Combination, Layout

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SAMPLE = 3


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "combination" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption("--layouts")
    if chosen == "all":
        combinations = list(layouts.space())
    elif chosen == "sample":
        combinations = layouts.sample(sample_seed(), SAMPLE)
    else:
        combinations = list(layouts.iterate(chosen))
    metafunc.parametrize("combination", combinations, ids=[c.id for c in combinations])


def test_layout_gives_the_reference_numbers(combination: Combination, request: pytest.FixtureRequest) -> None:
    # The training step is a second compilation: the whole space takes it on each spec's
    # first mesh, the suite's sample leaves it out (test_moe_under_zero.py takes it).
    first = (layouts.meshes_of(combination.spec) or ("default",))[0]
    step = request.config.getoption("--layouts") != "sample" and combination.mesh == first
    outcome, tolerance = layouts.measure(combination, step)
    assert not layouts.failures(outcome, tolerance), layouts.failures(outcome, tolerance)


def test_the_space_covers_every_spec_layout_and_schedule() -> None:
    space = layouts.space()
    specs = layouts.all_specs()
    assert {c.spec for c in space} == set(specs)
    for name in specs:
        states = {(c.layout.state, c.layout.accumulate) for c in space if c.spec == name}
        assert states == {(g.state, g.accumulate) for g in layouts.GRID}, name
    pipelined = {c.spec for c in space if c.layout.schedule}
    assert {"gpt_small", "seed_mlp_pipeline", "moe_pipeline"} <= pipelined
    for name in pipelined:
        kinds = {c.layout.schedule for c in space if c.spec == name and c.layout.schedule}
        assert len(kinds) == len(layouts.SCHEDULE_KINDS) - 1, name
    # Every mesh named splits every axis; most specs have two.
    for c in space:
        assert c.mesh == "default" or all(int(n) >= 2 for n in c.mesh.split("x")), c.id
    two = [n for n in specs if len({c.mesh for c in space if c.spec == n}) >= 2]
    assert len(two) >= len(specs) - 2


def test_layouts_edit_only_the_train_section() -> None:
    text = "model m\nmesh data=2\ntrain {\n  zero 1\n  accumulate 4\n  optimizer sgd(lr=0.1)\n}\n"
    out = layouts.with_layout(text, Layout("fsdp", 2), ("data",))
    assert "zero" not in out and "accumulate 4" not in out
    assert "accumulate 2" in out and "fsdp data" in out and "optimizer sgd(lr=0.1)" in out
    assert layouts.with_layout("model m\n", Layout("zero3"), ()).endswith("train {\n  accumulate 1\n  zero 3\n}\n")
