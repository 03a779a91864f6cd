"""Constants of every kind (integers, numbers with a fraction, booleans) and `--set` on them."""

from __future__ import annotations

from pathlib import Path

import pytest

import dslc
from dslc import cli
from dslc.ir import nodes as ir

SPEC = """model m
mesh data=2
const d = 16
const eps = 1e-5
const learned_bias = false
const same_eps = eps
input x: f32[8 @ data, d]
input y: f32[8 @ data, d]
forward(x) {
  ln: layernorm(d, eps=same_eps, bias=learned_bias)
  loss: mse(y)
}
"""


def norm(overrides: dict[str, int | float | bool] | list[str] | None = None) -> ir.Layer:
    analysis = dslc.analyze(SPEC, overrides=overrides)
    assert analysis.ok and analysis.program is not None, analysis.diagnostics
    return ir.all_layers(analysis.program)[0]


def test_float_and_boolean_constants_reach_layer_arguments() -> None:
    layer = norm()
    assert layer.attr("eps") == 1e-5 and layer.attr("bias") is False
    assert [w.name for w in layer.weights] == ["scale"]
    assert dict(dslc.analyze(SPEC).program.constants)["same_eps"] == 1e-5  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("overrides", "eps", "bias"),
    [
        (["eps=1e-6"], 1e-6, False),
        (["eps=2"], 2.0, False),  # an integer is taken as the number it is
        (["learned_bias=true"], 1e-5, True),
        ({"eps": 0.5, "learned_bias": True}, 0.5, True),
        ({"eps": 3}, 3.0, False),
        (["same_eps=0.25"], 0.25, False),
    ],
)
def test_set_overrides_numbers_and_booleans(
    overrides: dict[str, int | float | bool] | list[str], eps: float, bias: bool
) -> None:
    layer = norm(overrides)
    assert layer.attr("eps") == eps and isinstance(layer.attr("eps"), float)
    assert layer.attr("bias") is bias
    assert [w.name for w in layer.weights] == (["scale", "bias"] if bias else ["scale"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eps=true"], "cannot set `eps` to true: it is a number (line 4: `const eps = 1e-5`)"),
        (["learned_bias=1"], "cannot set `learned_bias` to 1: it is a boolean (true or false) (line 5:"),
        (["d=2.0"], "cannot set `d` to 2.0: it is an integer (line 3: `const d = 16`)"),
        ({"d": True}, "cannot set `d` to true: it is an integer"),
        (["eps=nan"], "--set takes NAME=VALUE (an integer, a number or true/false), got 'eps=nan'"),
        (["eps=1e-5x"], "got 'eps=1e-5x'"),
        ({"eps": float("inf")}, "must be set to an integer, a finite number or a boolean"),
        ({"eps": "0.1"}, "must be set to an integer, a finite number or a boolean"),
        (["nope=1"], "cannot set `nope`: the spec defines no constant `nope`"),
    ],
)
def test_set_refuses_values_of_another_kind(overrides: dict[str, object] | list[str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        dslc.analyze(SPEC, overrides=overrides)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_a_number_where_an_integer_is_needed_is_an_error() -> None:
    diags = dslc.check(SPEC.replace("input x: f32[8 @ data, d]", "input x: f32[8 @ data, eps]"))
    assert [(d.code, d.message) for d in diags if d.span.line == 7] == [
        ("E025", "`eps` is a number with a fraction, but an integer is needed here")
    ]


def test_cli_set_of_the_wrong_kind_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.par"
    path.write_text(SPEC)
    assert cli.main(["check", str(path), "--set", "eps=1e-6", "--set", "learned_bias=true"]) == 0
    assert cli.main(["check", str(path), "--set", "learned_bias=yes"]) == 2
    assert "--set takes NAME=VALUE" in capsys.readouterr().err
