"""Text to syntax tree: the Lark grammar, a Transformer to AST nodes, syntax errors as data."""

from __future__ import annotations

import functools
from typing import Any

import lark
from lark import Lark, Token, Transformer, v_args

from dslc import resources
from dslc.diagnostics import Diagnostic, Span, error
from dslc.syntax import ast
from dslc.syntax.source import Source, check_nesting

# Integers longer than this are kept as text only; the checker reports them as too large
# (and Python's int() refuses numbers of more than ~4300 digits anyway).
_MAX_INT_DIGITS = 64
TOO_LARGE = 10**_MAX_INT_DIGITS

# The parse tree may be no deeper than this. Brackets are already limited by
# `source.MAX_NESTING`, but a run of unary minus signs (`- - - 1`) nests without them, and
# every later pass (the transformer, evaluation, the formatter) recurses on the tree.
MAX_TREE_DEPTH = 200


@functools.cache
def _parser() -> Lark:
    return Lark(
        resources.grammar_path().read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=False,
    )


def parse(source: Source) -> tuple[ast.Module | None, list[Diagnostic]]:
    """Parse one file. On a syntax error, returns no tree and one diagnostic."""
    nesting = check_nesting(source)
    if nesting:
        return None, nesting
    try:
        tree = _parser().parse(source.text)
    except lark.UnexpectedInput as exc:
        return None, [_syntax_error(source, exc)]
    too_deep = _too_deep(source, tree)
    if too_deep:
        return None, too_deep
    comments = _comments(source.text)
    module = _ToAst(source.name).transform(tree)
    assert isinstance(module, ast.Module)
    file_span = Span(source.name, 1, 1, source.text.count("\n") + 1, 1)
    return ast.Module(
        module.items,
        file_span,
        tuple(ast.Comment(t.value, _token_span(source.name, t)) for t in comments),
    ), []


def _comments(text: str) -> list[Token]:
    """Every `#` comment with its position. The language's only quoted text, a schedule
    file's path, cannot hold a `#`, so the first `#` on a line always starts a comment; a line
    scan finds them exactly."""
    out: list[Token] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        pos = raw.find("#")
        if pos >= 0:
            value = raw[pos:].rstrip()
            out.append(
                Token("COMMENT", value, line=number, column=pos + 1, end_line=number, end_column=pos + 1 + len(value))
            )
    return out


def _too_deep(source: Source, tree: lark.Tree[Token]) -> list[Diagnostic]:
    """Refuse a tree deeper than MAX_TREE_DEPTH, found without recursion."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            meta = node.meta
            line, column = getattr(meta, "line", 1), getattr(meta, "column", 1)
            span = Span(source.name, line, column, line, column + 1)
            msg = f"the spec is nested more than {MAX_TREE_DEPTH} levels deep here"
            return [error("E003", msg, span, help="flatten the expression or block")]
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, lark.Tree))
    return []


# ---- syntax errors -------------------------------------------------------------------------

_TOKEN_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "SCHEDULE_NAME": "a schedule name",
    "STRING": "a quoted file path",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "COMMA": "`,`",
    "COLON": "`:`",
    "EQUAL": "`=`",
    "AT": "`@`",
    "MINUS": "`-`",
    "ADD_OP": "`+` or `-`",
    "MUL_OP": "`*` or `//`",
    "$END": "end of file",
}


def _describe(terminal: str) -> str:
    if terminal in _TOKEN_WORDS:
        return _TOKEN_WORDS[terminal]
    try:
        pattern = _parser().get_terminal(terminal).pattern
    except KeyError:
        return terminal
    if isinstance(pattern, lark.lexer.PatternStr):
        return f"`{pattern.value}`"
    return terminal.lower()


def _expected(names: set[str]) -> str:
    words = sorted({_describe(n) for n in names if not n.startswith("__ANON")})
    if not words:
        return ""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(source: Source, exc: lark.UnexpectedInput) -> Diagnostic:
    line = getattr(exc, "line", 1) or 1
    column = getattr(exc, "column", 1) or 1
    if isinstance(exc, lark.UnexpectedCharacters):
        pos = exc.pos_in_stream
        ch = source.text[pos] if pos is not None and pos < len(source.text) else ""
        span = Span(source.name, line, column, line, column + 1)
        expected = _expected(set(exc.allowed or ()))
        shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
        return error(
            "E001",
            f"unexpected character {shown}",
            span,
            notes=[f"expected {expected}"] if expected else [],
            help="names use ASCII letters, digits and `_`; comments start with `#`"
            if not ch.isascii() or not ch.isprintable()
            else None,
        )
    if isinstance(exc, lark.UnexpectedToken):
        tok = exc.token
        expected = _expected(set(exc.expected))
        if tok.type == "$END":
            end_line = source.text.count("\n") + 1
            last = source.text.rsplit("\n", 1)[-1]
            span = Span(source.name, end_line, len(last) + 1, end_line, len(last) + 2)
            return error(
                "E001",
                "unexpected end of file",
                span,
                notes=[f"expected {expected}"] if expected else [],
                help="a `{` or `(` may be missing its closing partner",
            )
        span = _token_span(source.name, tok)
        return error(
            "E001",
            f"unexpected `{tok.value}`",
            span,
            notes=[f"expected {expected}"] if expected else [],
        )
    span = Span(source.name, line, column, line, column + 1)
    return error("E001", "syntax error", span)


def _token_span(name: str, tok: Token) -> Span:
    line = tok.line or 1
    column = tok.column or 1
    end_line = tok.end_line or line
    end_column = tok.end_column or column + len(tok.value)
    return Span(name, line, column, end_line, end_column)


# ---- parse tree to AST ---------------------------------------------------------------------


class _MeshNodes(list[Any]):
    """A mesh axis's `across N nodes` clause between the transformer's rules: [N]."""


@v_args(meta=True)
class _ToAst(Transformer[Token, Any]):
    """One small method per grammar rule; each node gets the span of the text it came from."""

    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _span(self, meta: Any) -> Span:
        if getattr(meta, "empty", True):
            return Span(self.file, 1, 1, 1, 1)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _ident(self, tok: Token) -> ast.Ident:
        return ast.Ident(str(tok), _token_span(self.file, tok))

    # header
    def start(self, meta: Any, items: list[ast.Item]) -> ast.Module:
        return ast.Module(tuple(items), self._span(meta))

    def model_decl(self, meta: Any, c: list[Any]) -> ast.ModelDecl:
        return ast.ModelDecl(self._ident(c[0]), self._span(meta))

    def mesh_decl(self, meta: Any, c: list[ast.MeshAxis]) -> ast.MeshDecl:
        return ast.MeshDecl(tuple(c), self._span(meta))

    def mesh_axis(self, meta: Any, c: list[Any]) -> ast.MeshAxis:
        nodes = c.pop()[0] if isinstance(c[-1], _MeshNodes) else None
        return ast.MeshAxis(self._ident(c[0]), c[1] if len(c) > 1 else None, self._span(meta), nodes)

    def mesh_nodes(self, meta: Any, c: list[Any]) -> _MeshNodes:
        return _MeshNodes(c)

    def const_decl(self, meta: Any, c: list[Any]) -> ast.ConstDecl:
        return ast.ConstDecl(self._ident(c[0]), c[1], self._span(meta))

    def input_decl(self, meta: Any, c: list[Any]) -> ast.InputDecl:
        return ast.InputDecl(self._ident(c[0]), c[1], self._span(meta))

    def tensor_type(self, meta: Any, c: list[Any]) -> ast.TensorType:
        return ast.TensorType(self._ident(c[0]), tuple(c[1:]), self._span(meta))

    def dim(self, meta: Any, c: list[Any]) -> ast.Dim:
        return ast.Dim(c[0], c[1] if len(c) > 1 else None, self._span(meta))

    def axis_one(self, meta: Any, c: list[Token]) -> ast.AxisSet:
        return ast.AxisSet((self._ident(c[0]),), self._span(meta))

    def axis_many(self, meta: Any, c: list[Token]) -> ast.AxisSet:
        return ast.AxisSet(tuple(self._ident(t) for t in c), self._span(meta))

    def replicated(self, meta: Any, c: list[Any]) -> ast.AxisSet:
        return ast.AxisSet((), self._span(meta))

    # body
    def block_def(self, meta: Any, c: list[Any]) -> ast.BlockDef:
        params = tuple(x for x in c[1:] if isinstance(x, ast.Param))
        checkpoint = next((x for x in c if isinstance(x, ast.Checkpoint)), None)
        body = tuple(x for x in c[1:] if not isinstance(x, (ast.Param, ast.Checkpoint)))
        return ast.BlockDef(self._ident(c[0]), params, checkpoint, body, self._span(meta))

    def param(self, meta: Any, c: list[Any]) -> ast.Param:
        return ast.Param(self._ident(c[0]), c[1] if len(c) > 1 else None, self._span(meta))

    def checkpoint(self, meta: Any, c: list[Token]) -> ast.Checkpoint:
        saved = tuple(self._ident(t) for t in c[1:])
        return ast.Checkpoint(self._ident(c[0]), saved, len(c) > 1, self._span(meta))

    def forward_def(self, meta: Any, c: list[Any]) -> ast.ForwardDef:
        return ast.ForwardDef(self._ident(c[0]), tuple(c[1:]), self._span(meta))

    def label(self, meta: Any, c: list[Token]) -> ast.Ident:
        return self._ident(c[0])

    def layer_stmt(self, meta: Any, c: list[Any]) -> ast.LayerStmt:
        label = c[0] if isinstance(c[0], ast.Ident) else None
        call = next(x for x in c if isinstance(x, ast.Call))
        shards = next((x for x in c if isinstance(x, tuple) and x and isinstance(x[0], ast.WeightShard)), ())
        ties = next((x for x in c if isinstance(x, tuple) and x and isinstance(x[0], ast.WeightTie)), ())
        return ast.LayerStmt(label, call, shards, ties, self._span(meta))

    def call(self, meta: Any, c: list[Any]) -> ast.Call:
        args = tuple(a if isinstance(a, ast.Arg) else ast.Arg(None, a, a.span) for a in c[1:])
        return ast.Call(self._ident(c[0]), args, self._span(meta))

    def keyword_arg(self, meta: Any, c: list[Any]) -> ast.Arg:
        return ast.Arg(self._ident(c[0]), c[1], self._span(meta))

    def shard_clause(self, meta: Any, c: list[ast.WeightShard]) -> tuple[ast.WeightShard, ...]:
        return tuple(c)

    def weight_shard(self, meta: Any, c: list[Any]) -> ast.WeightShard:
        return ast.WeightShard(self._ident(c[0]), tuple(c[1:]), self._span(meta))

    def tie_clause(self, meta: Any, c: list[ast.WeightTie]) -> tuple[ast.WeightTie, ...]:
        return tuple(c)

    def weight_tie(self, meta: Any, c: list[Token]) -> ast.WeightTie:
        return ast.WeightTie(self._ident(c[0]), tuple(self._ident(t) for t in c[1:]), self._span(meta))

    def residual_stmt(self, meta: Any, c: list[Any]) -> ast.ResidualStmt:
        label = c[0] if c and isinstance(c[0], ast.Ident) else None
        body = tuple(c[1:] if label else c)
        return ast.ResidualStmt(label, body, self._span(meta))

    def branch_stmt(self, meta: Any, c: list[Any]) -> ast.BranchStmt:
        label = c[0] if c and isinstance(c[0], ast.Ident) else None
        body = tuple(c[1:] if label else c)
        return ast.BranchStmt(label, body, self._span(meta))

    def stream_stmt(self, meta: Any, c: list[Any]) -> ast.StreamStmt:
        return ast.StreamStmt(self._ident(c[0]), self._ident(c[1]), tuple(c[2:]), self._span(meta))

    def repeat_stmt(self, meta: Any, c: list[Any]) -> ast.RepeatStmt:
        label = c[0] if isinstance(c[0], ast.Ident) else None
        rest = c[1:] if label else c
        count, tail = rest[0], rest[1:]
        if len(tail) == 1 and isinstance(tail[0], ast.Call):
            return ast.RepeatStmt(label, count, tail[0], (), self._span(meta))
        return ast.RepeatStmt(label, count, None, tuple(tail), self._span(meta))

    def stage_stmt(self, meta: Any, c: list[Any]) -> ast.StageStmt:
        return ast.StageStmt(tuple(c), self._span(meta))

    def stages_stmt(self, meta: Any, c: list[Any]) -> ast.StagesStmt:
        return ast.StagesStmt(tuple(c), self._span(meta))

    def layout_stmt(self, meta: Any, c: list[ast.AxisSet]) -> ast.LayoutStmt:
        return ast.LayoutStmt(tuple(c), self._span(meta))

    # plan
    def pipeline_def(self, meta: Any, c: list[Any]) -> ast.PipelineDef:
        return ast.PipelineDef(self._ident(c[0]), tuple(c[1:]), self._span(meta))

    def schedule_setting(self, meta: Any, c: list[Token]) -> ast.ScheduleSetting:
        return ast.ScheduleSetting(self._ident(c[0]), self._span(meta))

    def schedule_file(self, meta: Any, c: list[Token]) -> ast.ScheduleFile:
        return ast.ScheduleFile(str(c[0])[1:-1], self._span(meta))

    def train_def(self, meta: Any, c: list[ast.Setting]) -> ast.TrainDef:
        return ast.TrainDef(tuple(c), self._span(meta))

    def setting(self, meta: Any, c: list[Any]) -> ast.Setting:
        return ast.Setting(self._ident(c[0]), tuple(c[1:]), self._span(meta))

    # values
    def int_lit(self, meta: Any, c: list[Token]) -> ast.IntLit:
        digits = str(c[0]).replace("_", "")
        value = int(digits) if len(digits) <= _MAX_INT_DIGITS else TOO_LARGE
        return ast.IntLit(value, str(c[0]), self._span(meta))

    def float_lit(self, meta: Any, c: list[Token]) -> ast.FloatLit:
        text = str(c[0])
        return ast.FloatLit(float(text.replace("_", "")), text, self._span(meta))

    def true_lit(self, meta: Any, c: list[Any]) -> ast.BoolLit:
        return ast.BoolLit(True, self._span(meta))

    def false_lit(self, meta: Any, c: list[Any]) -> ast.BoolLit:
        return ast.BoolLit(False, self._span(meta))

    def name_ref(self, meta: Any, c: list[Token]) -> ast.NameRef:
        return ast.NameRef(str(c[0]), self._span(meta))

    def neg(self, meta: Any, c: list[Any]) -> ast.Neg:
        return ast.Neg(c[0], self._span(meta))

    def sum(self, meta: Any, c: list[Any]) -> ast.Expr:
        return self._chain(meta, c)

    def product(self, meta: Any, c: list[Any]) -> ast.Expr:
        return self._chain(meta, c)

    def _chain(self, meta: Any, c: list[Any]) -> ast.Expr:
        if len(c) == 1:
            return c[0]
        first: ast.Expr = c[0]
        rest = tuple((str(c[i]), c[i + 1]) for i in range(1, len(c), 2))
        # `(a - b) - c` means `a - b - c`: both operators of a level associate to the left,
        # so a parenthesised chain of the same level on the left is the same flat chain.
        if isinstance(first, ast.Chain) and _LEVEL[first.rest[0][0]] == _LEVEL[rest[0][0]]:
            inner = first
            first, rest = inner.first, inner.rest + rest
        return ast.Chain(first, rest, self._span(meta))


_LEVEL = {"+": 1, "-": 1, "*": 2, "//": 2}
