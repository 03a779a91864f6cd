"""A language model's vocabulary: a head tied to its embedding, and a vocabulary padded to split.

Tied weights (`tie kernel = wte.table.T`): the head's kernel is the embedding's table
transposed, one parameter, counted once, placed once, exported once, whose gradient is the
sum of both uses, on one device and through a pipeline whose first stage holds the embedding
and whose last holds the head.

Padding: GPT-2's 50257 tokens over model=2 and model=4. The embedding's table and the head
are stored padded (50258, 50260 rows), the padded logits are masked out of the softmax, and
the loss, the logits and every gradient are the unpadded model's on one device
(tests/reference.py, which computes with the weights as declared). Weights go in and out
unpadded; the padding is zero and stays zero.

Tolerance: f32 against single-device jax (a plain function written here, and
tests/reference.py), relative to each array's largest entry (the loss to its value): 1e-5.
The sharded runs add their partial sums in other orders (vocab-parallel lookups and softmax
statistics, data-parallel gradient sums, pipeline microbatches). Measured: losses within
1.2e-7, logits within 5e-7 and gradients within 1.2e-6 (2x2, 1x4 and 2x2x2 meshes, tied and
untied, specs/gpt2.par shrunk the worst). 1e-5 is eight times that and far below a real
mistake:

* a missing use: either use's part of the tied table's gradient alone is off by about 1
  (0.95 and 1.05 of the gradient's largest entry);
* a padded logit let into the softmax would move a loss near 10.8 by only about
  log(1 + 1/50257) ~ 2e-5, under the tolerance: what catches it is the padding's own
  gradient, exactly zero when masked and the softmax's 1/50257 share otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dslc
from dslc import cli
from dslc.ir import nodes as ir
from dslc.ir.placement import place
from dslc.layers.inputs import InputError
from dslc.plan import plan
from dslc.plan.tensors import tensors
from dslc.syntax.format import format_module
from dslc.syntax.parser import parse
from dslc.syntax.source import from_text
from tests import reference
from tests.conftest import SPECS, TEST_SPECS, compiled

# Compiles and runs programs: left out of the quick run, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # see the module docstring

TIED = (TEST_SPECS / "tied.par").read_text()


def pipelined(vocab: int) -> str:
    """The embedding on stage 0, the head tied to it on stage 1: the table is stored once,
    split over the stage axis between steps, and both stages' gradients of it are summed."""
    return f"""model tied_pipeline
mesh data=2, model=2, stage=2
input tokens: i32[8 @ data, 16]
input targets: i32[8 @ data, 16]
forward(tokens) {{
  wte: embed({vocab}, 32) shard table[model, _]
  stages {{
    blocks: repeat 2 {{
      ln: layernorm(32)
      fc: linear(32, 32) shard kernel[_, model], bias[model]
      gelu()
      proj: linear(32, 32) shard kernel[model, _]
    }}
  }}
  ln_f: layernorm(32)
  head: linear(32, {vocab}, bias=false) tie kernel = wte.table.T
  loss: cross_entropy(targets)
}}
pipeline stage {{
  schedule 1f1b
  microbatches 2
}}
"""


PIPELINED = pipelined(64)

# A GPT-2-sized vocabulary on a tiny model: the embedding split over `model`, the head tied to it.
GPT2_VOCAB = (TEST_SPECS / "gpt2_vocab.par").read_text()
UNTIED = GPT2_VOCAB.replace("tie kernel = wte.table.T", "shard kernel[_, model]")


def _program(text: str, mesh: str | None = None) -> ir.Program:
    analysis = dslc.analyze(text, mesh=mesh)
    assert analysis.ok and analysis.program is not None, analysis.diagnostics
    return analysis.program


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ---- tied weights ---------------------------------------------------------------------------------


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


# ---- vocabulary padding ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "rows"), [("2x2", 50258), ("1x4", 50260)])
def test_the_vocabulary_is_padded_to_split_and_declared_unpadded(mesh: str, rows: int) -> None:
    program = _program(GPT2_VOCAB, mesh)
    table = next(n for n in ir.all_layers(program) if n.path == "wte").weight("table")
    assert (table.type.shape, table.padding, table.shape) == ((rows, 16), (rows - 50257, 0), (50257, 16))
    assert ir.weights_by_path(program)["wte.table"].shape == (50257, 16)
    loss = program.loss
    assert loss is not None and loss.input.shape == (4, 8, rows) and loss.attr("classes") == 50257
    p = plan(program)
    assert p.parameters == 50257 * 16 + 2 * 16  # the model's own: padding is not a parameter
    (padding,) = p.padding
    assert (padding.weight, padding.declared, padding.stored) == ("wte.table", (50257, 16), (rows, 16))
    assert padding.parameters == (rows - 50257) * 16 and padding.axes == ("model",)
    assert p.logits_padding is not None and (p.logits_padding.classes, p.logits_padding.width) == (50257, rows)
    # On one device nothing is split, so nothing is padded.
    alone = _program(GPT2_VOCAB, "1x1")
    assert alone.loss is not None and alone.loss.input.shape == (4, 8, 50257) and not plan(alone).padding


@pytest.mark.parametrize(
    ("text", "mesh"),
    [(GPT2_VOCAB, "2x2"), (GPT2_VOCAB, "1x4"), (UNTIED, "2x2"), (pipelined(63), None)],
    ids=["tied-model2", "tied-model4", "untied-model2", "pipelined"],
)
def test_padding_changes_no_logit_loss_or_gradient(text: str, mesh: str | None) -> None:
    c = compiled(text, mesh)
    parameters = c.program.module.PARAMETERS
    padded = {name: p for name, p in parameters.items() if any(p.padding)}
    assert padded
    # The masked logits take no gradient: the padding's stays exactly zero.
    stored = c.program.stored_grads(c.model, c.batch)
    for name, p in padded.items():
        padding = np.array(stored[name])
        padding[tuple(slice(0, n - pad) for n, pad in zip(p.shape, p.padding, strict=True))] = 0
        assert not padding.any(), name
    want = reference.evaluate(c.program.ir, c.weights, c.batch)
    assert c.output.shape == want.output.shape  # the padding cut off
    assert _relative(c.output, want.output) <= TOLERANCE
    assert want.loss is not None and abs(c.loss - want.loss) <= TOLERANCE * abs(want.loss)
    assert set(c.grads) == set(want.grads)
    for name, g in want.grads.items():
        assert c.grads[name].shape == g.shape
        assert _relative(c.grads[name], g) <= TOLERANCE, name


def test_the_padding_is_zero_and_stays_zero_through_training() -> None:
    c = compiled(GPT2_VOCAB, "2x2")
    program = c.program
    model = program.init(1)
    stored = np.asarray(model.arrays()["wte.table"])
    assert stored.shape == (50258, 16) and not stored[50257:].any() and stored[:50257].any()
    state = program.init_optimizer(model)
    for step in range(2):
        state, _ = program.train_step(model, state, c.batch, step)
    after = np.asarray(model.arrays()["wte.table"])
    assert not after[50257:].any() and not np.array_equal(after[:50257], stored[:50257])
    # The same seed gives the same weights whether or not they are padded.
    alone = compiled(GPT2_VOCAB, "1x1")
    assert np.array_equal(program.export_weights(program.init(0))["wte.table"], alone.weights["wte.table"])


def test_weights_go_out_and_in_unpadded() -> None:
    c = compiled(GPT2_VOCAB, "1x4")
    program, weights = c.program, c.weights
    assert weights["wte.table"].shape == (50257, 16)
    model = program.init(3)
    program.import_weights(model, weights)
    stored = np.asarray(model.arrays()["wte.table"])
    assert stored.shape == (50260, 16) and not stored[50257:].any()
    assert np.array_equal(stored[:50257], weights["wte.table"])
    assert np.array_equal(program.export_weights(model)["wte.table"], weights["wte.table"])


def test_targets_past_the_real_classes_are_refused() -> None:
    c = compiled(GPT2_VOCAB, "2x2")
    assert int(c.batch["targets"].max()) < 50257
    batch = {**c.batch, "targets": c.batch["targets"].copy()}
    batch["targets"][0, 3] = 50257  # a padded logit's index
    with pytest.raises(InputError, match=r"holds 50257 at index \[0, 3\]"):
        c.program.loss(c.model, batch)


def test_dslc_plan_says_the_vocabulary_is_padded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "padded.par"
    spec.write_text(GPT2_VOCAB)
    assert cli.main(["plan", str(spec)]) == 0
    text = capsys.readouterr().out
    assert "vocabulary padded to split evenly" in text
    assert "wte.table [50257, 16] -> [50258, 16] over model: +16 parameters" in text
    assert "logits 50257 -> 50258 wide, masked out of the loss" in text
    assert cli.main(["plan", str(spec), "--format", "json"]) == 0
    padding = json.loads(capsys.readouterr().out)["padding"]
    assert padding["arrays"][0]["stored"] == [50258, 16] and padding["logits"]["classes"] == 50257


def test_a_loss_told_its_classes_masks_logits_padded_by_hand() -> None:
    """`classes` is the loss's own argument: a head padded by hand to 64 outputs, masked to 63,
    computes the 63-output model's loss."""
    by_hand = """model by_hand
mesh data=2
input x: f32[4 @ data, 8, 16]
input targets: i32[4 @ data, 8]
forward(x) {
  head: linear(16, 64, bias=false)
  loss: cross_entropy(targets, classes=63)
}
"""
    c = compiled(by_hand)
    kernel = c.weights["head.kernel"]
    narrow = _program(by_hand.replace("linear(16, 64", "linear(16, 63").replace(", classes=63", ""))
    want = reference.evaluate(narrow, {"head.kernel": kernel[:, :63]}, c.batch)
    assert want.loss is not None and abs(c.loss - want.loss) <= TOLERANCE * abs(want.loss)
    assert _relative(c.grads["head.kernel"][:, :63], want.grads["head.kernel"]) <= TOLERANCE
    assert not c.grads["head.kernel"][:, 63:].any()


# specs/gpt2.par shrunk as tests/codegen/test_codegen.py shrinks it (one compilation serves both): its
# vocabulary odd like GPT-2's, tied, padded over `model`, through its 2x2x2 pipeline.
GPT2_SHRUNK = {"vocab": 95, "positions": 32, "d": 32, "heads": 4, "layers": 2, "seq": 16, "batch": 8}


def test_specs_gpt2_ties_and_pads_through_its_pipeline() -> None:
    c = compiled(SPECS / "gpt2.par", overrides=GPT2_SHRUNK)
    table = c.program.module.PARAMETERS["wte.table"]
    assert (table.shape, table.padding) == ((96, 32), (1, 0)) and "lm_head.kernel" not in c.weights
    want = reference.evaluate(c.program.ir, c.weights, c.batch)
    assert c.output.shape == want.output.shape == (8, 16, 95)
    assert _relative(c.output, want.output) <= TOLERANCE
    assert want.loss is not None and abs(c.loss - want.loss) <= TOLERANCE * abs(want.loss)
    assert set(c.grads) == set(want.grads)
    # A key bias's gradient vanishes in exact arithmetic (the softmax takes away the same q . bias
    # added to a whole row): both sides hold rounding noise, measured against all the gradients.
    scale = max(float(np.max(np.abs(g))) for g in want.grads.values())
    for name, g in want.grads.items():
        error = (
            np.max(np.abs(c.grads[name] - g)) / scale if name.endswith("attn.k_bias") else _relative(c.grads[name], g)
        )
        assert error <= TOLERANCE, name
