"""Attention's kernels in compiled programs: tests/specs/packed.par (documents packed into
sequences of 1024 tokens, sliding-window and global flash attention over two blocks, grouped
heads split over `model`) against the single-device reference, a packed document getting
what it would get alone, the core each layer names, and the checker's diagnostics for the
new arguments.

Tolerances: the numerics tests' f32 3e-5 (tests/tolerances.py). Measured here: forward 8e-7,
loss 2e-7, worst gradient 8e-7 on the default mesh.
"""

from __future__ import annotations

import numpy as np
import pytest

import dslc
from dslc.diagnostics import Diagnostic
from tests import reference
from tests.conftest import TEST_SPECS, compiled
from tests.tolerances import F32, assert_grads_close, relative_error

PACKED = TEST_SPECS / "packed.par"


@pytest.mark.slow
def test_packed_documents_match_the_reference() -> None:
    """On the default mesh; the layout tests (tests/lower/test_layouts.py) hold it to the same
    reference on others and under every ZeRO stage."""
    run = compiled(PACKED)
    want = reference.evaluate(run.program.ir, run.weights, run.batch)
    assert want.loss is not None
    assert relative_error(run.output, want.output) <= F32.forward
    assert relative_error(run.loss, want.loss) <= F32.loss
    assert_grads_close(run.grads, want.grads, F32.grads)


@pytest.mark.slow
def test_a_packed_document_gets_what_it_would_get_alone() -> None:
    """Row 0 packs documents A (300 tokens) and B (724); row 1 holds B alone, first, then
    filler of another document: B's logits are the same in both (its positions restart,
    nothing of A or the filler reaches it)."""
    run = compiled(PACKED, mesh="1x1")
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 64, 300), rng.integers(0, 64, 724)
    tokens = np.zeros((4, 1024), np.int32)
    docs = np.zeros((4, 1024), np.int32)
    tokens[0] = np.concatenate([a, b])
    docs[0, 300:] = 1
    tokens[1] = np.concatenate([b, rng.integers(0, 64, 300)])
    docs[1, 724:] = 1
    batch = {"tokens": tokens, "docs": docs}
    logits = np.asarray(run.program.forward(run.model, batch))
    packed, alone = logits[0, 300:], logits[1, :724]
    assert relative_error(packed, alone) <= F32.forward
    # And A's logits do not depend on B: the same with B replaced.
    other = tokens.copy()
    other[0, 300:] = rng.integers(0, 64, 724)
    again = np.asarray(run.program.forward(run.model, {"tokens": other, "docs": docs}))
    assert relative_error(again[0, :300], logits[0, :300]) <= F32.forward


def test_each_layer_names_its_core() -> None:
    """kernel=flash, and `auto` by length: dense under 1024 tokens, flash from 1024 or with
    packed documents (the generated module says which, with its block)."""
    from dslc.codegen import generate_module

    text = generate_module(PACKED)
    assert text.count('kernel="flash",\n            block=512,') == 2
    assert "window=100" in text
    tiny = generate_module(TEST_SPECS.parent.parent / "specs" / "tiny.par")
    assert 'kernel="dense"' in tiny and "flash" not in tiny


HEADER = "model m\nmesh data=2, model=2\ninput x: f32[2 @ data, 16, 32]\ninput y: f32[2 @ data, 16, 32]\n"


def check(attention: str, header: str = HEADER, mesh: str | None = None) -> list[Diagnostic]:
    return [d for d in dslc.check(header + f"forward(x) {{\n  a: {attention}\n  loss: mse(y)\n}}\n", mesh=mesh)]


@pytest.mark.parametrize(
    ("attention", "code", "said"),
    [
        ("attention(32, 4, causal=false, window=8)", "E024", "a sliding window keeps the latest keys before"),
        ("attention(32, 4, kernel=fast)", "E024", "`kernel` of `attention` is one of auto, dense, flash"),
        ("attention(32, 4, kernel=2)", "E024", "`kernel` of `attention` is one of auto, dense, flash"),
        (
            "attention(32, 4, segments=y)",
            "E016",
            "`segments` of `a` reads input `y`, which is f32[2@data, 16, 32]: it needs integer ids",
        ),
        ("attention(32, 4, segments=nowhere)", "E010", "unknown input `nowhere`"),
    ],
)
def test_the_new_arguments_are_checked(attention: str, code: str, said: str) -> None:
    errors = [d for d in check(attention) if d.is_error]
    assert [d.code for d in errors] == [code], errors
    assert said in errors[0].message


def test_document_ids_are_split_like_the_tokens() -> None:
    header = HEADER + "input docs: i32[2, 16]\n"
    (d,) = [d for d in check("attention(32, 4, segments=docs)", header) if d.is_error]
    assert d.code == "E017" and "split as i32[2, 16]" in d.message


def test_ring_attention_takes_no_window_or_documents() -> None:
    header = "model m\nmesh context=2\ninput x: f32[2, 16 @ context, 32]\ninput y: f32[2, 16 @ context, 32]\n"
    header_docs = header + "input docs: i32[2, 16 @ context]\n"
    (window,) = [d for d in check("attention(32, 4, window=4)", header) if d.is_error]
    (docs,) = [d for d in check("attention(32, 4, segments=docs)", header_docs) if d.is_error]
    assert window.code == docs.code == "E029"
    assert "takes no sliding window" in window.message and "does not take packed documents" in docs.message
