"""`dslc fmt`: the canonical text of a spec.

One statement per line, two-space indentation, single spaces around operators, the fewest
parentheses that keep the meaning (but `-(-x)`, not `--x`), at most one blank line where the
author left one (none just inside a brace), `{}` for an empty body. Comments are kept: a
comment alone on its line stays before the statement that followed it; a comment after code
stays at the end of that statement's line; comments inside a statement written over several
lines (which is printed on one) go on lines of their own after it, in their order.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.syntax import ast

INDENT = "  "


@dataclass
class _Line:
    indent: int
    text: str
    src: int  # the source line this printed line stands for
    closing: bool = False
    opening: bool = False
    comment: str | None = None


def format_module(module: ast.Module, source_text: str) -> str:
    """The canonical text of `module`, which was parsed from `source_text`."""
    printer = _Printer({c.span.line for c in module.comments})
    for item in module.items:
        printer.item(item)
    lines = printer.lines
    _attach_comments(lines, module.comments, source_text)
    _keep_blank_lines(lines, source_text)
    return _render(lines)


# ---- statements ----------------------------------------------------------------------------------


class _Printer:
    def __init__(self, comment_lines: set[int]) -> None:
        self.lines: list[_Line] = []
        self.depth = 0
        self.comment_lines = comment_lines

    def emit(self, text: str, src: int, closing: bool = False, opening: bool = False) -> None:
        self.lines.append(_Line(self.depth, text, src, closing, opening))

    def body(self, header: str, span_line: int, stmts: tuple[ast.Stmt, ...], end_line: int) -> None:
        if self.open(header, span_line, bool(stmts), end_line):
            for s in stmts:
                self.stmt(s)
            self.close(end_line)

    def open(self, header: str, line: int, nonempty: bool, end_line: int) -> bool:
        """`header {` and True, or `header {}` and False for an empty body with no comment
        inside (a comment inside needs lines of its own)."""
        if nonempty or any(line < c < end_line for c in self.comment_lines):
            self.emit(header + " {", line, opening=True)
            self.depth += 1
            return True
        self.emit(header + " {}", line)
        return False

    def close(self, end_line: int) -> None:
        self.depth -= 1
        self.emit("}", end_line, closing=True)

    def item(self, item: ast.Item) -> None:
        line = item.span.line
        match item:
            case ast.ModelDecl(name=name):
                self.emit(f"model {name.text}", line)
            case ast.MeshDecl(axes=axes):
                self.emit("mesh " + ", ".join(_mesh_axis(a) for a in axes), line)
            case ast.ConstDecl(name=name, value=v):
                self.emit(f"const {name.text} = {value(v)}", line)
            case ast.InputDecl(name=name, type=t):
                self.emit(f"input {name.text}: {_tensor_type(t)}", line)
            case ast.BlockDef(name=name, params=params, checkpoint=cp, body=body):
                header = f"block {name.text}({', '.join(_param(p) for p in params)})"
                if cp is not None:
                    header += " checkpoint " + cp.policy.text
                    if cp.saved:
                        header += "(" + ", ".join(i.text for i in cp.saved) + ")"
                self.body(header, line, body, item.span.end_line)
            case ast.ForwardDef(input=inp, body=body):
                self.body(f"forward({inp.text})", line, body, item.span.end_line)
            case ast.PipelineDef(axis=axis, items=items):
                if self.open(f"pipeline {axis.text}", line, bool(items), item.span.end_line):
                    for s in items:
                        self.setting(s)
                    self.close(item.span.end_line)
            case ast.TrainDef(settings=settings):
                if self.open("train", line, bool(settings), item.span.end_line):
                    for s in settings:
                        self.setting(s)
                    self.close(item.span.end_line)

    def setting(self, s: ast.PipelineItem) -> None:
        match s:
            case ast.ScheduleSetting(kind=kind):
                self.emit(f"schedule {kind.text}", s.span.line)
            case ast.ScheduleFile(path=path):
                self.emit(f'schedule file "{path}"', s.span.line)
            case ast.Setting(key=key, values=values):
                self.emit(f"{key.text} " + ", ".join(_setting_value(v) for v in values), s.span.line)

    def stmt(self, s: ast.Stmt) -> None:
        line = s.span.line
        match s:
            case ast.LayerStmt(label=label, call=call, shards=shards, ties=ties):
                text = _label(label) + _call(call)
                if ties:
                    text += " tie " + ", ".join(f"{t.weight.text} = {t.path}" for t in ties)
                if shards:
                    text += " shard " + ", ".join(_weight_shard(w) for w in shards)
                self.emit(text, line)
            case ast.ResidualStmt(label=label, body=body):
                self.body(_label(label) + "residual", line, body, s.span.end_line)
            case ast.BranchStmt(label=label, body=body):
                self.body(_label(label) + "branch", line, body, s.span.end_line)
            case ast.StreamStmt(label=label, source=source, body=body):
                self.body(f"stream {label.text}({source.text})", line, body, s.span.end_line)
            case ast.RepeatStmt(label=label, count=count, call=call, body=body):
                head = f"{_label(label)}repeat {expr(count)}"
                if call is not None:
                    self.emit(f"{head} {_call(call)}", line)
                else:
                    self.body(head, line, body, s.span.end_line)
            case ast.StageStmt(body=body):
                self.body("stage", line, body, s.span.end_line)
            case ast.StagesStmt(body=body):
                self.body("stages", line, body, s.span.end_line)
            case ast.LayoutStmt(dims=dims):
                self.emit("layout [" + ", ".join(_axes(d) for d in dims) + "]", line)


# ---- pieces ----------------------------------------------------------------------------------------


def _label(label: ast.Ident | None) -> str:
    return f"{label.text}: " if label is not None else ""


def _mesh_axis(a: ast.MeshAxis) -> str:
    text = a.name.text if a.size is None else f"{a.name.text}={expr(a.size)}"
    return text if a.nodes is None else f"{text} across {expr(a.nodes)} nodes"


def _param(p: ast.Param) -> str:
    return p.name.text if p.default is None else f"{p.name.text}={value(p.default)}"


def _tensor_type(t: ast.TensorType) -> str:
    dims = ", ".join(expr(d.size) + (f" @ {_axes(d.sharding)}" if d.sharding else "") for d in t.dims)
    return f"{t.dtype.text}[{dims}]"


def _axes(a: ast.AxisSet) -> str:
    if not a.axes:
        return "_"
    if len(a.axes) == 1:
        return a.axes[0].text
    return "(" + ", ".join(i.text for i in a.axes) + ")"


def _weight_shard(w: ast.WeightShard) -> str:
    return f"{w.weight.text}[{', '.join(_axes(d) for d in w.dims)}]"


def _call(c: ast.Call) -> str:
    args = ", ".join(value(a.value) if a.name is None else f"{a.name.text}={value(a.value)}" for a in c.args)
    return f"{c.callee.text}({args})"


def _setting_value(v: ast.Value | ast.Call) -> str:
    return _call(v) if isinstance(v, ast.Call) else value(v)


def value(v: ast.Value) -> str:
    match v:
        case ast.FloatLit(text=text):
            return text
        case ast.BoolLit(value=b):
            return "true" if b else "false"
        case _:
            return expr(v)


_LEVEL = {"+": 1, "-": 1, "*": 2, "//": 2}


def expr(e: ast.Expr) -> str:
    """Print with the fewest parentheses that parse back to the same tree."""
    match e:
        case ast.IntLit(text=text):
            return text
        case ast.NameRef(name=name):
            return name
        case ast.Neg(operand=operand):
            inner = expr(operand)
            return f"-({inner})" if isinstance(operand, ast.Chain | ast.Neg) else f"-{inner}"
        case ast.Chain(first=first, rest=rest):
            level = _LEVEL[rest[0][0]]
            out = _operand(first, level, left=True)
            for op, operand in rest:
                out += f" {op} {_operand(operand, level, left=False)}"
            return out
    raise AssertionError(e)


def _operand(e: ast.Expr, level: int, left: bool) -> str:
    text = expr(e)
    if isinstance(e, ast.Chain):
        inner = _LEVEL[e.rest[0][0]]
        # A lower-precedence chain always needs parentheses; one of the same level needs
        # them on the right (a - (b - c)), and on the left too, since the parser keeps
        # same-level chains flat and `(a - b) - c` is a different tree from `a - b - c`.
        if inner < level or inner == level:
            return f"({text})"
    return text


# ---- comments and blank lines ------------------------------------------------------------------------


def _attach_comments(lines: list[_Line], comments: tuple[ast.Comment, ...], source_text: str) -> None:
    source_lines = source_text.split("\n")
    inserts: dict[int, list[_Line]] = {}
    tail: list[_Line] = []
    for c in comments:
        L = c.span.line
        before = source_lines[L - 1][: c.span.column - 1]
        if before.strip():
            # After code on the first line of what a printed line stands for: it stays at the
            # end of that line. Later lines of a statement written over several lines are
            # joined into one printed line, so their comments follow it, in their order.
            owner = _last_at_or_before(lines, L)
            if owner is not None and owner.src == L and owner.comment is None:
                owner.comment = c.text
                continue
        target = next((i for i, line in enumerate(lines) if line.src >= L), None)
        if target is None:
            tail.append(_Line(0, c.text, L))
            continue
        at = lines[target]
        indent = at.indent + 1 if at.closing else at.indent
        inserts.setdefault(target, []).append(_Line(indent, c.text, L))
    merged: list[_Line] = []
    for i, line in enumerate(lines):
        merged.extend(inserts.get(i, []))
        merged.append(line)
    merged.extend(tail)
    lines[:] = merged


def _last_at_or_before(lines: list[_Line], src: int) -> _Line | None:
    found = None
    for line in lines:
        if line.src <= src:
            found = line
        else:
            break
    return found


def _keep_blank_lines(lines: list[_Line], source_text: str) -> None:
    """Where the author left a blank line between two printed lines, keep one (but not just
    after an opening or before a closing brace)."""
    source_lines = source_text.split("\n")
    out: list[_Line] = []
    for prev, line in zip([None, *lines], lines, strict=False):
        if prev is not None and not prev.opening and not line.closing and line.src > prev.src + 1:
            gap = source_lines[prev.src : line.src - 1]
            if any(not g.strip() for g in gap):
                out.append(_Line(0, "", line.src))
        out.append(line)
    lines[:] = out


def _render(lines: list[_Line]) -> str:
    out = []
    for line in lines:
        if not line.text:
            out.append("")
            continue
        text = INDENT * line.indent + line.text
        if line.comment:
            text += "  " + line.comment
        out.append(text)
    return "\n".join(out).strip("\n") + "\n"
