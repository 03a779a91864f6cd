"""Tied weights (`tie kernel = wte.table.T`): one stored array that two layers read.

The head's kernel is the embedding's table transposed: one parameter, counted once, placed
once, exported once, whose gradient is the sum of both uses — on one device and through a
pipeline whose first stage holds the embedding and whose last holds the head.

Tolerances. Both comparisons are f32 against single-device jax (a plain function written
here, and tests/reference.py); the sharded runs add their partial sums in other orders
(vocab-parallel lookups and softmax statistics, data-parallel gradient sums, pipeline
microbatches). Measured: on a 2x2 mesh the loss is exact and the gradients within 3e-7 of
their largest entry; through the pipeline (2x2x2) the loss within 1.1e-7 relative and the
worst gradient within 6.5e-7. The tolerance, 1e-5, is fifteen times that and far below a
missing use: either use's part of the table's gradient alone is off by about 1 (0.95 and
1.05 of the gradient's largest entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import dslc
from dslc.ir import nodes as ir
from dslc.ir.placement import place
from dslc.plan import plan
from dslc.plan.tensors import tensors
from dslc.syntax.format import format_module
from dslc.syntax.parser import parse
from dslc.syntax.source import from_text
from tests import reference
from tests.conftest import compiled

TOLERANCE = 1e-5  # of the array's largest entry: see the module docstring

TIED = """model tied
mesh data=2, model=2
input tokens: i32[8 @ data, 16]
input targets: i32[8 @ data, 16]
forward(tokens) {
  wte: embed(64, 32) shard table[model, _]
  ln: layernorm(32)
  head: linear(32, 64, bias=false) tie kernel = wte.table.T
  loss: cross_entropy(targets)
}
"""

# The embedding on stage 0, the head on stage 1: the table is stored once, split over the
# stage axis between steps, and both stages' gradients of it are summed.
PIPELINED = """model tied_pipeline
mesh data=2, model=2, stage=2
input tokens: i32[8 @ data, 16]
input targets: i32[8 @ data, 16]
forward(tokens) {
  wte: embed(64, 32) shard table[model, _]
  stages {
    blocks: repeat 2 {
      ln: layernorm(32)
      fc: linear(32, 32) shard kernel[_, model], bias[model]
      gelu()
      proj: linear(32, 32) shard kernel[model, _]
    }
  }
  ln_f: layernorm(32)
  head: linear(32, 64, bias=false) tie kernel = wte.table.T
  loss: cross_entropy(targets)
}
pipeline stage {
  schedule 1f1b
  microbatches 2
}
"""


def _program(text: str) -> ir.Program:
    analysis = dslc.analyze(text)
    assert analysis.ok and analysis.program is not None, analysis.diagnostics
    return analysis.program


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _formatted(text: str) -> str:
    source, _ = from_text(text)
    assert source is not None
    module, diags = parse(source)
    assert module is not None, diags
    return format_module(module, text)


def test_the_tie_clause_parses_and_formats_back() -> None:
    messy = TIED.replace("tie kernel = wte.table.T", "tie   kernel=wte . table.T")
    assert _formatted(messy) == TIED


def test_a_tied_weight_is_one_parameter_stored_once() -> None:
    for text in (TIED, PIPELINED):
        program = _program(text)
        assert "head.kernel" not in ir.weights_by_path(program)
        stored = [a.name for a in place(program).arrays]
        assert stored.count("wte.table") == 1 and not any(name.startswith("head") for name in stored)
    program = _program(TIED)
    # 64 x 32 table + layernorm's scale and bias; the head adds nothing.
    assert plan(program).parameters == 64 * 32 + 2 * 32
    head = next(row for row in tensors(program).rows if row.path == "head")
    (kernel,) = head.weights
    assert kernel.stored == "wte.table" and not kernel.first
    # The head reads the table transposed: vocab-parallel table, column-parallel head.
    layer = next(n for n in ir.all_layers(program) if n.path == "head")
    assert layer.weight("kernel").type.sharding == ((), ("model",))
    assert layer.output.sharding == (("data",), (), ("model",))


def _plain_loss(
    table: jax.Array, scale: jax.Array, bias: jax.Array, tokens: jax.Array, targets: jax.Array
) -> jax.Array:
    """The tied model written out in jax on one device: the table looked up, then read
    transposed as the head."""
    x = table[tokens]
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias
    logits = jnp.einsum("bsd,vd->bsv", h, table, precision=jax.lax.Precision.HIGHEST)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def test_the_tied_model_computes_a_plain_jax_model() -> None:
    c = compiled(TIED)
    w, batch = c.weights, c.batch
    loss, grads = jax.value_and_grad(_plain_loss, argnums=(0, 1, 2))(
        w["wte.table"], w["ln.scale"], w["ln.bias"], batch["tokens"], batch["targets"]
    )
    assert abs(c.loss - float(loss)) <= TOLERANCE * abs(float(loss))
    for name, want in zip(("wte.table", "ln.scale", "ln.bias"), grads, strict=True):
        assert _relative(c.grads[name], np.asarray(want)) <= TOLERANCE, name
    assert set(c.grads) == {"wte.table", "ln.scale", "ln.bias"}


def test_under_a_pipeline_the_tied_gradient_is_the_sum_of_both_stages() -> None:
    c = compiled(PIPELINED)
    stored = c.program.module.PARAMETERS["wte.table"]
    assert stored.stage_split is not None  # split over the stages between steps, gathered for the step
    want = reference.evaluate(c.program.ir, c.weights, c.batch)
    assert want.loss is not None and abs(c.loss - want.loss) <= TOLERANCE * abs(want.loss)
    assert set(c.grads) == set(want.grads)
    for name, g in want.grads.items():
        assert _relative(c.grads[name], g) <= TOLERANCE, name
    # The sum of both uses: the same model untied, its head's kernel a copy of the table,
    # has the two parts as gradients of two weights; either alone is far off.
    untied = _program(PIPELINED.replace("tie kernel = wte.table.T", "shard kernel[_, model]"))
    copied = {**c.weights, "head.kernel": c.weights["wte.table"].T}
    parts = reference.evaluate(untied, copied, c.batch).grads
    lookup, head = parts["wte.table"], parts["head.kernel"].T
    assert _relative(c.grads["wte.table"], lookup + head) <= TOLERANCE
    assert min(_relative(c.grads["wte.table"], part) for part in (lookup, head)) > 0.1
