"""How an argument reads in the spec's own constants: what the generated module writes in
their names (`heads=HEADS`, `(D, FFN)`) where it would otherwise print a number."""

from __future__ import annotations

from collections.abc import Mapping

from dslc.syntax import ast
from dslc.syntax.format import value as value_text


def spelled(v: ast.Value, spellings: Mapping[str, str]) -> str | None:
    """`v` written in the names `spellings` gives each of its names (a block's parameter as
    the constants its use passed); None where a name has no spelling."""

    def substituted(e: ast.Expr) -> ast.Expr | None:
        match e:
            case ast.NameRef(name=name):
                text = spellings.get(name)
                if text is None:
                    return None
                # A name standing for more than one token is bracketed where it is put.
                return ast.NameRef(text if text.replace("_", "").isalnum() else f"({text})", e.span)
            case ast.Neg(operand=operand):
                inner = substituted(operand)
                return None if inner is None else ast.Neg(inner, e.span)
            case ast.Chain(first=first, rest=rest):
                head = substituted(first)
                tail = [(op, substituted(operand)) for op, operand in rest]
                kept = tuple((op, t) for op, t in tail if t is not None)
                return None if head is None or len(kept) < len(tail) else ast.Chain(head, kept, e.span)
            case _:
                return e

    if isinstance(v, ast.FloatLit | ast.BoolLit):
        return value_text(v)
    out = substituted(v)
    return None if out is None else value_text(out)
