"""Integer arithmetic over named constants, and the values of call arguments."""

from __future__ import annotations

from collections.abc import Mapping

from dslc.diagnostics import Diagnostics
from dslc.ir.names import unknown_name
from dslc.syntax import ast

# Large enough for any real model dimension or FLOP count, small enough to stay exact in
# every backend's integer type.
MAX_INT = 2**62

ScalarValue = int | float | bool


def eval_expr(
    e: ast.Expr, scope: Mapping[str, ScalarValue], diags: Diagnostics, *, suggest: tuple[str, ...] = ()
) -> int | None:
    """The integer an expression denotes, or None after reporting why it has none."""
    match e:
        case ast.IntLit(value=value):
            return _bounded(value, e, diags)
        case ast.NameRef(name=name):
            if name not in scope:
                diags.add(unknown_name("constant", name, e.span, tuple(scope) + suggest))
                return None
            known = scope[name]
            if isinstance(known, bool) or not isinstance(known, int):
                diags.error("E025", f"`{name}` is {_kind(known)}, but an integer is needed here", e.span)
                return None
            return known
        case ast.Neg(operand=operand):
            inner = eval_expr(operand, scope, diags, suggest=suggest)
            return None if inner is None else -inner
        case ast.Chain(first=first, rest=rest):
            acc = eval_expr(first, scope, diags, suggest=suggest)
            for op, operand in rest:
                rhs = eval_expr(operand, scope, diags, suggest=suggest)
                if acc is None or rhs is None:
                    acc = None
                    continue
                if op == "//" and rhs == 0:
                    diags.error("E025", "division by zero", operand.span)
                    acc = None
                    continue
                acc = {"+": acc + rhs, "-": acc - rhs, "*": acc * rhs, "//": acc // rhs if rhs else 0}[op]
                if _bounded(acc, e, diags) is None:
                    return None
            return acc
    raise AssertionError(f"not an expression: {e!r}")


def _bounded(value: int, e: ast.Expr, diags: Diagnostics) -> int | None:
    if abs(value) > MAX_INT:
        diags.error("E025", "number too large", e.span, notes=[f"the largest allowed magnitude is 2**62 = {MAX_INT}"])
        return None
    return value


def _kind(value: ScalarValue) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return "a number with a fraction" if isinstance(value, float) else "an integer"


def eval_value(v: ast.Value, scope: Mapping[str, ScalarValue], diags: Diagnostics) -> ScalarValue | None:
    """Any argument value: integer arithmetic, a float, a boolean, or a name bound to one."""
    match v:
        case ast.FloatLit(value=value):
            if value != value or value in (float("inf"), float("-inf")):
                diags.error("E025", "number too large", v.span)
                return None
            return value
        case ast.BoolLit(value=value):
            return value
        case ast.NameRef(name=name) if isinstance(scope.get(name), (float, bool)):
            return scope[name]
        case _:
            return eval_expr(v, scope, diags)
