"""Gradients summed in f32 beside 16-bit parameters (`train { grad_dtype f32 }`, Megatron's
`main_grad`, DeepSpeed's fp32 gradient partition).

The reference is independent of the runtime's sums: the gradient of each accumulation slice,
computed alone by a one-slice program, summed in float64 by numpy. Summed in f32 the step
equals it to f32's rounding; summed in bf16 (no `grad_dtype`) each of the sixteen additions
rounds to bf16's 8 bits, and the result is off by a few parts in a thousand.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dslc
from dslc.plan import plan

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SLICES = 16
SPEC = """
model wide_grads
mesh MESH
const d = 32
const batch = 64
input x: f32[batch @ data, d]
input y: f32[batch @ data, d]
block mlp(d) {
  residual {
    ln: layernorm(d)
    up: linear(d, 4 * d) shard kernel[_, model], bias[model]
    gelu()
    down: linear(4 * d, d) shard kernel[model, _]
  }
}
forward(x) {
  layers: repeat 2 mlp(d)
  loss: mse(y)
}
train {
  param_dtype bf16
  compute_dtype bf16
SETTINGS
}
"""


def spec(mesh: str, settings: str) -> str:
    return SPEC.replace("MESH", mesh).replace("SETTINGS", settings)


def relative(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.linalg.norm(a[k] - b[k]) / np.linalg.norm(b[k])) for k in b)


@pytest.fixture(scope="module")
def slices_summed_exactly() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the batch, the float64 sum of its slices' gradients, each slice computed alone as the
    accumulating step cuts it: rows j, j + SLICES, ... — and weighed 1 / SLICES)."""
    one = dslc.compile(spec("data=1, model=2", ""), overrides={"batch": 64 // SLICES})
    full = dslc.compile(spec("data=1, model=2", f"  accumulate {SLICES}"))
    batch = full.example_batch(0)
    model = one.init(0)
    total: dict[str, np.ndarray] = {}
    for j in range(SLICES):
        grads = one.grads(model, {k: v[j::SLICES] for k, v in batch.items()})
        for name, g in grads.items():
            total[name] = total.get(name, 0.0) + np.asarray(g, np.float64) / SLICES
    return batch, total


def test_gradients_summed_in_f32_equal_the_exact_sum_of_the_slices(
    slices_summed_exactly: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    batch, exact = slices_summed_exactly
    wide = dslc.compile(spec("data=1, model=2", f"  accumulate {SLICES}\n  grad_dtype f32"))
    narrow = dslc.compile(spec("data=1, model=2", f"  accumulate {SLICES}"))
    got_wide, got_narrow = (p.grads(p.init(0), batch) for p in (wide, narrow))
    assert all(g.dtype == np.float32 for g in got_wide.values())
    assert all(g.dtype == jnp.bfloat16 for g in got_narrow.values())
    # f32 sums of the bf16 slices: f32's rounding (6e-8) times a few additions.
    assert relative(got_wide, exact) < 1e-6
    # bf16 sums: each addition rounds to 2^-9 relative (measured: a few 1e-3).
    assert relative(got_narrow, exact) > 1e-4


def test_a_pipeline_sums_its_microbatches_in_f32(
    slices_summed_exactly: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """The executor's accumulator: microbatch i takes rows i, i + M, ..., as an accumulation
    slice does, so the same exact sum is the reference."""
    batch, exact = slices_summed_exactly
    pipelined = spec("data=1, model=2, stage=2", "  grad_dtype f32").replace(
        "  layers: repeat 2 mlp(d)\n", "  stages {\n    layers: repeat 2 mlp(d)\n  }\n"
    )
    pipelined += f"pipeline stage {{\n  schedule gpipe\n  microbatches {SLICES}\n}}\n"
    program = dslc.compile(pipelined)
    got = program.grads(program.init(0), batch)
    assert all(g.dtype == np.float32 for g in got.values())
    assert relative(got, exact) < 1e-6


def test_data_parallel_sums_each_devices_slices_and_the_devices_in_f32(
    slices_summed_exactly: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """On two data rows each device cuts its own rows into slices (other rows than the
    one-device slices: bf16 rounds each slice's gradient differently, 2^-9 relative), sums
    them and then the two devices' sums, in f32."""
    batch, exact = slices_summed_exactly
    program = dslc.compile(spec("data=2, model=2", f"  accumulate {SLICES}\n  grad_dtype f32"))
    assert program.module.DATA_AXES == ("data",)
    got = program.grads(program.init(0), batch)
    assert all(g.dtype == np.float32 for g in got.values())
    assert relative(got, exact) < 1e-2


def test_the_plan_counts_gradients_in_f32_and_megatrons_18_bytes() -> None:
    """With a master copy, Adam and f32 gradients a parameter costs 2 + 4 + 12 bytes (the
    ZeRO paper's 16 with 16-bit gradients)."""

    def state(settings: str) -> tuple[int, int]:
        program = dslc.analyze(spec("data=1, model=1", settings)).program
        assert program is not None
        memory = plan(program).memory
        return memory.params + memory.grads + memory.optimizer, program_parameters(program)

    def program_parameters(program: object) -> int:
        return plan(program).parameters  # type: ignore[arg-type]

    sixteen, count = state("  master_dtype f32")
    eighteen, _ = state("  master_dtype f32\n  grad_dtype f32")
    assert (sixteen, eighteen) == (16 * count, 18 * count)
