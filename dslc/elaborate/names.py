"""Name the statements of a scope: the path part each layer, block use or repeat is stored under."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dslc.diagnostics import Diagnostics, Label
from dslc.syntax import ast


def name_statements(stmts: Sequence[ast.Stmt], diags: Diagnostics) -> dict[int, str]:
    """Names for the statements of one scope, by statement id. Unlabelled statements are named
    after what they call (`gelu`, or `gelu_0`, `gelu_1` when there are several); `residual`,
    `branch`, `stage` and `stages` without a label are transparent and share their parent's scope."""
    named = _named(stmts)
    labels = _labels(named, diags)
    bases = {id(s): _base(s) for s in named if getattr(s, "label", None) is None}
    counts = Counter(bases.values())
    out: dict[int, str] = {}
    used = set(labels)
    index: dict[str, int] = {}
    for s in named:
        label = getattr(s, "label", None)
        if label is not None:
            out[id(s)] = label.text
            continue
        base = bases[id(s)]
        if counts[base] == 1 and base not in used:
            name = base
        else:
            name = f"{base}_{index.get(base, 0)}"
            while name in used:
                index[base] = index.get(base, 0) + 1
                name = f"{base}_{index[base]}"
            index[base] = index.get(base, 0) + 1
        used.add(name)
        out[id(s)] = name
    return out


def _named(body: Sequence[ast.Stmt]) -> list[ast.Stmt]:
    """The statements of the scope that take a name, in order, looking through those that
    are transparent."""
    named: list[ast.Stmt] = []
    for s in body:
        match s:
            case ast.StageStmt(body=inner) | ast.StagesStmt(body=inner):
                named.extend(_named(inner))
            case ast.ResidualStmt(label=None, body=inner) | ast.BranchStmt(label=None, body=inner):
                named.extend(_named(inner))
            case ast.LayoutStmt():
                pass
            case _:
                named.append(s)
    return named


def _labels(named: Sequence[ast.Stmt], diags: Diagnostics) -> dict[str, ast.Ident]:
    """The labels written in the scope, each at its first use; a label used twice is reported."""
    labels: dict[str, ast.Ident] = {}
    for s in named:
        label = getattr(s, "label", None)
        if label is not None:
            if label.text in labels:
                diags.error(
                    "E011",
                    f"`{label.text}` names two layers in the same scope",
                    label.span,
                    labels=[Label(labels[label.text].span, "first used here")],
                )
            labels.setdefault(label.text, label)
    return labels


def _base(s: ast.Stmt) -> str:
    """What an unlabelled statement is named after."""
    match s:
        case ast.LayerStmt(call=call) | ast.RepeatStmt(call=ast.Call() as call):
            return call.callee.text
        case _:
            return "repeat" if isinstance(s, ast.RepeatStmt) else "residual"
