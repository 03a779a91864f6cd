"""Bind arguments: a call's arguments matched to what a layer or block takes, evaluated and
checked against their types, defaults filled in."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import cast

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.elaborate.flow import Scope
from dslc.elaborate.spelling import spelled
from dslc.ir.evaluate import ScalarValue, eval_value
from dslc.ir.names import closest, unknown_name
from dslc.layers.base import REQUIRED, ArgSpec
from dslc.syntax import ast

# What `_value` returns for an argument it reported as wrong.
INVALID = object()


def bind_arguments(
    specs: Sequence[ArgSpec],
    call: ast.Call,
    scope: Scope,
    what: str,
    inputs: Collection[str],
    diags: Diagnostics,
    globals_: Mapping[str, ScalarValue] | None = None,
    spans: dict[str, Span] | None = None,
    streams: Collection[str] = (),
    spellings: Mapping[str, str] | None = None,
    written: dict[str, str] | None = None,
) -> dict[str, object] | None:
    """The call's arguments bound to `specs` and evaluated, defaults filled in; None after
    reporting what is wrong. `inputs` are the declared inputs an argument of type "input" may
    name; one of type "stream" may name those or the `streams` computed before the call.
    `spans`, when given, receives where each argument written in the call is (those left to
    their defaults have none). `written`, when given with the `spellings` of the names in
    scope, receives each number or boolean written in the call, or a default written in the
    spec, as it reads in the spec's own constants (`4 * d`)."""
    raw = _match(specs, call, what, diags)
    if raw is None:
        return None
    if spans is not None:
        spans.update((name, arg.span) for name, arg in raw.items())
    ok = _all_given(specs, raw, call, what, diags)
    values: dict[str, object] = {}
    for spec in specs:
        if spec.name in raw:
            readable = [*inputs, *streams] if spec.type == "stream" else inputs
            value = _value(spec, raw[spec.name], scope, what, readable, diags)
            if value is INVALID:
                ok = False
                continue
            values[spec.name] = value
            if written is not None and spellings is not None and spec.type not in ("input", "stream", "choice"):
                _spell_into(written, spec.name, raw[spec.name].value, spellings)
        elif spec.default is REQUIRED:
            continue
        elif callable(spec.default):
            if ok:
                values[spec.name] = spec.default(values)
        elif isinstance(spec.default, ast.IntLit | ast.FloatLit | ast.BoolLit | ast.NameRef | ast.Neg | ast.Chain):
            # The arguments bound so far are scalars: a default refers to them by name.
            value = eval_value(spec.default, {**(globals_ or {}), **cast(Scope, values)}, diags)
            if value is None:
                ok = False
            else:
                values[spec.name] = value
                if written is not None and spellings is not None:
                    _spell_into(written, spec.name, spec.default, {**spellings, **written})
        else:
            values[spec.name] = spec.default
    return values if ok else None


def _spell_into(written: dict[str, str], name: str, v: ast.Value, spellings: Mapping[str, str]) -> None:
    text = spelled(v, spellings)
    if text is not None:
        written[name] = text


def _match(specs: Sequence[ArgSpec], call: ast.Call, what: str, diags: Diagnostics) -> dict[str, ast.Arg] | None:
    """The arguments written in the call, by the name of the spec each binds to; None after
    reporting one written out of order, past the positions, unknown, or twice."""
    seen_keyword = False
    ok = True
    for arg in call.args:
        if arg.name is not None:
            seen_keyword = True
        elif seen_keyword:
            diags.error("E024", "a positional argument cannot follow keyword arguments", arg.span)
            ok = False
    if not ok:
        # Binding positions out of order would only add "given twice" for the same slip.
        return None
    raw: dict[str, ast.Arg] = {}
    positional = [a for a in call.args if a.name is None]
    if len(positional) > len(specs):
        diags.error(
            "E024",
            f"{what} takes {len(specs)} positional argument{'s' if len(specs) != 1 else ''}, "
            f"but {len(positional)} were given",
            positional[len(specs)].span,
            notes=[f"{what} arguments: {', '.join(s.name for s in specs) or 'none'}"],
        )
        ok = False
    for spec, arg in zip(specs, positional, strict=False):
        raw[spec.name] = arg
    by_name = {s.name: s for s in specs}
    for arg in call.args:
        if arg.name is None:
            continue
        key = arg.name.text
        if key not in by_name:
            guess = closest(key, by_name)
            diags.error(
                "E024",
                f"{what} has no argument `{key}`",
                arg.name.span,
                notes=[f"{what} arguments: {', '.join(s.name for s in specs) or 'none'}"],
                help=f"did you mean `{guess}`?" if guess else None,
            )
            ok = False
        elif key in raw:
            diags.error(
                "E024",
                f"argument `{key}` is given twice",
                arg.span,
                labels=[Label(raw[key].span, "first given here")],
            )
            ok = False
        else:
            raw[key] = arg
    return raw if ok else None


def _all_given(
    specs: Sequence[ArgSpec], raw: Mapping[str, ast.Arg], call: ast.Call, what: str, diags: Diagnostics
) -> bool:
    """False after reporting the required arguments the call leaves out."""
    missing = [s for s in specs if s.name not in raw and s.default is REQUIRED]
    if not missing:
        return True
    # One report for all of them: they share the call's span, and one report per code
    # and span is kept.
    names = [f"`{s.name}`" + (f" ({s.doc})" if s.doc else "") for s in missing]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    diags.error(
        "E024",
        f"{what} needs argument{'s' if len(missing) > 1 else ''} {listed}",
        call.span,
        help=f"add {', '.join(f'`{s.name}=...`' for s in missing)}",
    )
    return False


def _value(
    spec: ArgSpec, arg: ast.Arg, scope: Scope, what: str, inputs: Collection[str], diags: Diagnostics
) -> object | None:
    """The value of one argument written in the call (None for `none` where the spec allows
    it); INVALID after reporting it is not of its spec's type."""
    v = arg.value
    if spec.type in ("input", "stream"):
        kind = "declared input" if spec.type == "input" else "declared input or an earlier `stream`"
        if not isinstance(v, ast.NameRef):
            diags.error("E024", f"`{spec.name}` of {what} names a {kind}", v.span)
            return INVALID
        if v.name not in inputs:
            diags.add(unknown_name("input" if spec.type == "input" else "input or stream", v.name, v.span, inputs))
            return INVALID
        return v.name
    if spec.type == "choice":
        if not isinstance(v, ast.NameRef) or v.name not in spec.choices:
            options = ", ".join(spec.choices)
            diags.error(
                "E024", f"`{spec.name}` of {what} is one of {options}", v.span, notes=[spec.doc] if spec.doc else []
            )
            return INVALID
        return v.name
    if spec.nullable and isinstance(v, ast.NameRef) and v.name == "none" and "none" not in scope:
        return None
    value = eval_value(v, scope, diags)
    if value is None:
        return INVALID
    match spec.type:
        case "any":
            return value
        case "bool":
            if not isinstance(value, bool):
                diags.error("E024", f"`{spec.name}` of {what} is true or false, got {_written(value)}", v.span)
                return INVALID
            return value
        case "int":
            if isinstance(value, bool) or not isinstance(value, int):
                diags.error("E024", f"`{spec.name}` of {what} is an integer, got {_written(value)}", v.span)
                return INVALID
            if spec.positive and value < 1:
                diags.error("E024", f"`{spec.name}` of {what} must be positive, got {value}", v.span)
                return INVALID
            return value
        case "float":
            if isinstance(value, bool):
                diags.error("E024", f"`{spec.name}` of {what} is a number, got {_written(value)}", v.span)
                return INVALID
            return float(value)
    raise AssertionError(spec.type)


def _written(value: object) -> str:
    """A value as a spec writes it (`true`, not Python's `True`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
