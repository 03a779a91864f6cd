"""Instantiate the forward body: blocks expanded at each use, repeats elaborated once, residuals,
branches and layouts, in the order the activation flows through them. Each statement is named
(`names`), its arguments bound (`arguments`), a built-in layer typed by its rule (`infer`), a
block's checkpoint resolved (`checkpoints`) as the walk reaches it, so every mistake is
reported where it was written, under the use that led to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.elaborate.arguments import bind_arguments
from dslc.elaborate.checkpoints import resolve_checkpoint
from dslc.elaborate.flow import UNKNOWN, Flow, Scope, Segment, Walk
from dslc.elaborate.header import Header
from dslc.elaborate.infer import infer_layer
from dslc.elaborate.layouts import fuse_reduce_scatter, relayout
from dslc.elaborate.names import name_statements
from dslc.elaborate.spelling import spelled
from dslc.elaborate.vocabulary import feeding_masked_losses
from dslc.elaborate.weights import check_shard_axes, report_uneven_once
from dslc.ir import nodes as ir
from dslc.ir.evaluate import eval_expr
from dslc.ir.names import unknown_name
from dslc.layers import RULES
from dslc.layers.base import REQUIRED, ArgSpec
from dslc.syntax import ast

MAX_REPEAT = 4096
MAX_NODES = 200_000


@dataclass(frozen=True, slots=True)
class Body:
    """The forward body instantiated: the input it reads and its top-level segments."""

    stream: str
    segments: list[Segment]
    # A `stage` was written below the top of the body (already reported).
    misplaced_stages: bool


def instantiate(fwd: ast.ForwardDef, header: Header, diags: Diagnostics) -> Body | None:
    """The body of `fwd`; None when the input it reads is not declared (reported)."""
    builder = _Builder(header, diags)
    found = builder.forward(fwd)
    report_uneven_once(builder.uneven, diags)
    if found is None:
        return None
    stream, segments = found
    return Body(stream, segments, builder.misplaced_stages)


class _Builder(Walk):
    def __init__(self, header: Header, diags: Diagnostics) -> None:
        super().__init__(header, diags)
        self.block_stack: list[str] = []
        self.count = 0
        self.too_big = False
        self.misplaced_stages = False
        # The input `forward` reads; `stream` is the one the statement being elaborated reads.
        self.main = ""

    # entry ---------------------------------------------------------------------------------------

    def forward(self, fwd: ast.ForwardDef) -> tuple[str, list[Segment]] | None:
        stream = fwd.input.text
        self.stream = self.main = stream
        if stream not in self.header.inputs:
            self.diags.add(unknown_name("input", stream, fwd.input.span, self.header.inputs))
            return None
        src = self.header.inputs[stream]
        flow = Flow(UNKNOWN if stream in self.header.untyped_inputs else src.type, src.span)
        self.heads = feeding_masked_losses(fwd.body)
        names = name_statements(fwd.body, self.diags)
        segments: list[Segment] = []
        scope: Scope = dict(self.header.constants)
        self.spellings = [{name: name for name in self.header.constants}]
        for stmt in fwd.body:
            match stmt:
                case ast.StageStmt(body=body) | ast.StagesStmt(body=body):
                    kind = "stage" if isinstance(stmt, ast.StageStmt) else "stages"
                    nodes = self._seq(body, flow, scope, "", names)
                    segments.append(Segment(kind, nodes, stmt.span))
                case _:
                    nodes = self._seq((stmt,), flow, scope, "", names)
                    if segments and segments[-1].kind == "loose":
                        segments[-1].nodes.extend(nodes)
                    else:
                        segments.append(Segment("loose", nodes, stmt.span))
        return stream, segments

    def _seq(
        self, stmts: Sequence[ast.Stmt], flow: Flow, scope: Scope, prefix: str, names: dict[int, str]
    ) -> list[ir.Node]:
        out: list[ir.Node] = []
        for stmt in _branch_runs(stmts):
            if self.too_big:
                break
            span = stmt.span if not isinstance(stmt, tuple) else stmt[0].span.to(stmt[-1].span)
            if flow.after_loss is not None and not isinstance(stmt, (ast.LayoutStmt,)):
                self.diags.error(
                    "E028",
                    "layers after the loss are never reached",
                    span,
                    labels=[Label(flow.after_loss, "the loss ends the forward pass here")],
                )
                flow.after_loss = None
            match stmt:
                case tuple():
                    out.append(self._branches(stmt, span, flow, scope, prefix, names))
                case ast.LayerStmt():
                    node = self._use(
                        stmt.call, stmt.shards, names[id(stmt)], flow, scope, prefix, stmt.span, ties=stmt.ties
                    )
                    if node is not None:
                        out.append(node)
                case ast.ResidualStmt():
                    out.append(self._residual(stmt, flow, scope, prefix, names))
                case ast.StreamStmt():
                    stream = self._stream(stmt, flow, scope, prefix)
                    if stream is not None:
                        out.append(stream)
                case ast.RepeatStmt():
                    out.extend(self._repeat(stmt, names[id(stmt)], flow, scope, prefix))
                case ast.LayoutStmt():
                    layout = relayout(stmt, flow, prefix, self.header, self.diags)
                    last = out[-1] if out else None
                    if isinstance(last, ir.Layer):
                        out[-1] = fuse_reduce_scatter(last, layout)
                    out.append(layout)
                case ast.StageStmt() | ast.StagesStmt():
                    keyword = "stage" if isinstance(stmt, ast.StageStmt) else "stages"
                    self.misplaced_stages = True
                    self.diags.error(
                        "E028",
                        f"`{keyword}` marks pipeline chunks and may only appear at the top of `forward`",
                        stmt.span,
                    )
                    out.extend(self._seq(stmt.body, flow, scope, prefix, names))
        return out

    def _residual(
        self, stmt: ast.ResidualStmt, flow: Flow, scope: Scope, prefix: str, names: dict[int, str]
    ) -> ir.Node:
        path = prefix + names[id(stmt)] if stmt.label else prefix.rstrip(".") or "residual"
        inner_prefix = prefix + stmt.label.text + "." if stmt.label else prefix
        inner_names = name_statements(stmt.body, self.diags) if stmt.label else names
        x = flow.type
        body = self._seq(stmt.body, flow, scope, inner_prefix, inner_names)
        y = flow.type
        if x is not UNKNOWN and y is not UNKNOWN:
            if y.shape != x.shape:
                self.diags.error(
                    "E016",
                    f"a residual branch must keep its input's shape, but it turns {x.describe()} into {y.describe()}",
                    stmt.span,
                    labels=[Label(flow.span, "branch output produced here")],
                )
            elif y.sharding != x.sharding:
                self.diags.error(
                    "E017",
                    "a residual branch must keep its input's sharding, "
                    f"but it turns {x.describe()} into {y.describe()}",
                    stmt.span,
                    labels=[Label(flow.span, "branch output produced here")],
                    help="end the branch with a row-parallel layer, or add `layout` to restore the sharding",
                )
        out_type = x if x is not UNKNOWN else UNKNOWN
        flow.type, flow.span = out_type, stmt.span
        return ir.Residual(path, tuple(body), x, out_type, stmt.span)

    def _stream(self, stmt: ast.StreamStmt, flow: Flow, scope: Scope, prefix: str) -> ir.Stream | None:
        """`stream NAME(SOURCE) { ... }`: the body run on input SOURCE, its output readable as
        NAME by the layers after it; the activation `flow` carries is left as it is."""
        name, source = stmt.label.text, stmt.source.text
        if prefix or self.depth or self.stream != self.main:
            self.diags.error(
                "E028",
                "`stream` computes an activation of its own from a declared input, so it may only appear "
                "at the top of `forward`",
                stmt.span,
                help="move the `stream` before the block or statement it sits in",
            )
            return None
        if name in self.header.inputs:
            self.diags.error(
                "E011",
                f"`{name}` names a declared input already, so a stream cannot take the name",
                stmt.label.span,
                labels=[Label(self.header.inputs[name].span, "declared here")],
            )
            return None
        if source not in self.header.inputs:
            self.diags.add(unknown_name("input", source, stmt.source.span, self.header.inputs))
            return None
        src = self.header.inputs[source]
        inner = Flow(UNKNOWN if source in self.header.untyped_inputs else src.type, src.span)
        self.stream = source
        try:
            body = self._seq(stmt.body, inner, scope, name + ".", name_statements(stmt.body, self.diags))
        finally:
            self.stream = self.main
        if inner.after_loss is not None:
            self.diags.error(
                "E028",
                "a loss ends the forward pass, so it cannot sit inside a `stream`",
                inner.after_loss,
                help="compute the loss at the end of `forward`, after the stream is read",
            )
            inner.type = UNKNOWN
        if not stmt.body:
            self.diags.error(
                "E028",
                f"stream `{name}` has no layers, so it is input `{source}` itself",
                stmt.span,
                help=f"read `{source}` by its own name, or give the stream the layers that compute it",
            )
            return None
        self.streams[name] = ir.Input(name, inner.type, stmt.span)
        if inner.type is UNKNOWN:
            self.untyped_streams.add(name)
        return ir.Stream(name, source, tuple(body), flow.type, flow.type, inner.type, stmt.span)

    def _branches(
        self,
        run: tuple[ast.BranchStmt, ...],
        span: Span,
        flow: Flow,
        scope: Scope,
        prefix: str,
        names: dict[int, str],
    ) -> ir.Node:
        """Consecutive branches: each arm runs on the same input, and the arms' outputs are
        summed, so they must agree in shape and sharding."""
        if len(run) == 1:
            self.diags.error(
                "E028",
                "a `branch` alone has nothing to be summed with",
                run[0].span,
                help="write its layers without `branch`, or follow it with the branch it is summed with",
            )
        x, start = flow.type, flow.span
        arms: list[tuple[ir.Node, ...]] = []
        ends: list[Flow] = []
        for stmt in run:
            arm = Flow(x, start, classes=flow.classes)
            inner_prefix = prefix + stmt.label.text + "." if stmt.label else prefix
            inner_names = name_statements(stmt.body, self.diags) if stmt.label else names
            arms.append(tuple(self._seq(stmt.body, arm, scope, inner_prefix, inner_names)))
            if arm.after_loss is not None:
                self.diags.error(
                    "E028",
                    "a loss ends the forward pass, so it cannot sit inside a `branch`",
                    arm.after_loss,
                    help="compute the loss after the branches are summed",
                )
                arm.type = UNKNOWN  # reported once, not again as the arms' shapes
            ends.append(arm)
        first = ends[0]
        for stmt, end in zip(run[1:], ends[1:], strict=True):
            y, z = first.type, end.type
            if y is UNKNOWN or z is UNKNOWN:
                continue
            labels = [Label(first.span, f"the first branch's output, {y.describe()}, produced here")]
            if z.shape != y.shape:
                self.diags.error(
                    "E016",
                    f"branches' outputs are summed, so they must have one shape, but this branch makes {z.describe()}",
                    stmt.span,
                    labels=labels,
                )
            elif z.sharding != y.sharding:
                self.diags.error(
                    "E017",
                    f"branches' outputs are summed, so they must be sharded alike, but this branch makes "
                    f"{z.describe()}",
                    stmt.span,
                    labels=labels,
                    help="end every branch with the same sharding: a row-parallel layer, or `layout`",
                )
        known = all(end.type is not UNKNOWN for end in ends)
        out_type = first.type if known else UNKNOWN
        flow.type, flow.span, flow.classes = out_type, span, first.classes
        path = prefix.rstrip(".") or "branches"
        return ir.Branches(path, tuple(arms), x, out_type, span, tuple(stmt.span for stmt in run))

    def _repeat(self, stmt: ast.RepeatStmt, name: str, flow: Flow, scope: Scope, prefix: str) -> list[ir.Node]:
        """A run of one block, elaborated once: the block must hand the next copy what it
        received (the same type), so every copy computes the same function of its own weights.
        A block that changes its input's type cannot loop; its copies are elaborated one by
        one instead (each names its layers `NAME.i.…`, as a loop's would be named)."""
        count = eval_expr(stmt.count, scope, self.diags)
        if count is None:
            return []
        if not 1 <= count <= MAX_REPEAT:
            self.diags.error("E024", f"repeat count must be between 1 and {MAX_REPEAT}, got {count}", stmt.count.span)
            return []
        x = flow.type
        start = Flow(flow.type, flow.span, flow.after_loss)
        body = self._repeat_body(stmt, f"{prefix}{name}", name, flow, scope, prefix)
        if body is None:
            return []
        if count == 1 or x is UNKNOWN or body.output == x:
            written = spelled(stmt.count, self.spellings[-1]) or ""
            return [ir.Repeat(f"{prefix}{name}", body, count, span=stmt.span, written=written)]
        flow.type, flow.span, flow.after_loss = start.type, start.span, start.after_loss
        out: list[ir.Node] = []
        for i in range(count):
            block = self._repeat_body(stmt, f"{prefix}{name}.{i}", f"{name}.{i}", flow, scope, prefix, quiet=i > 0)
            if block is None:
                break
            out.append(block)
        return out

    def _repeat_body(
        self, stmt: ast.RepeatStmt, path: str, name: str, flow: Flow, scope: Scope, prefix: str, quiet: bool = False
    ) -> ir.Block | None:
        """One copy of a repeat's block at `path`: the block it calls, or its written body; a
        repeated built-in layer is wrapped in a block of its own."""
        x = flow.type
        self.depth += 1
        self.repeats += 1
        try:
            if stmt.call is not None:
                node = self._use(stmt.call, (), name, flow, scope, prefix, stmt.span, quiet=quiet)
                if node is None:
                    return None
                if isinstance(node, ir.Block):
                    return node
                return ir.Block(path, stmt.call.callee.text, ir.Remat(), (node,), x, flow.type, stmt.span)
            body = self._seq(stmt.body, flow, scope, path + ".", name_statements(stmt.body, self.diags))
            return ir.Block(path, "repeat", ir.Remat(), tuple(body), x, flow.type, stmt.span)
        finally:
            self.depth -= 1
            self.repeats -= 1

    # one use of a layer or block ---------------------------------------------------------------------------

    def _use(
        self,
        call: ast.Call,
        shards: tuple[ast.WeightShard, ...],
        name: str,
        flow: Flow,
        scope: Scope,
        prefix: str,
        span: Span,
        quiet: bool = False,
        ties: tuple[ast.WeightTie, ...] = (),
    ) -> ir.Node | None:
        self.count += 1
        if self.count > MAX_NODES:
            self.diags.error(
                "E025", f"the model expands to more than {MAX_NODES} layers", span, help="reduce repeat counts"
            )
            self.too_big = True
            return None
        callee = call.callee.text
        path = prefix + name
        if callee in RULES:
            return infer_layer(self, RULES[callee], call, shards, ties, path, flow, scope, span)
        if callee in self.header.blocks:
            clauses: tuple[tuple[str, str, tuple[ast.WeightShard, ...] | tuple[ast.WeightTie, ...], str], ...] = (
                ("E027", "shard", shards, "put the `shard` on the layers inside the block"),
                ("E032", "tie", ties, "tie the weight of a layer written at the top of `forward`"),
            )
            for code, keyword, written, fix in clauses:
                if written:
                    message = f"`{keyword}` applies to the weights of a built-in layer, not to a block"
                    self.diags.error(code, message, written[0].span, help=fix)
            return self._block(self.header.blocks[callee], call, path, flow, scope)
        if not quiet:
            self.diags.add(unknown_name("layer or block", callee, call.callee.span, (*RULES, *self.header.blocks)))
            check_shard_axes(shards, path, self.header, self.diags)
        flow.type = UNKNOWN
        return None

    def _block(self, block: ast.BlockDef, call: ast.Call, path: str, flow: Flow, scope: Scope) -> ir.Node | None:
        name = block.name.text
        if name in self.block_stack:
            chain = " -> ".join([*self.block_stack[self.block_stack.index(name) :], name])
            self.diags.error(
                "E028",
                f"block `{name}` uses itself ({chain})",
                call.span,
                labels=[Label(block.name.span, "defined here")],
            )
            flow.type = UNKNOWN
            return None
        specs = tuple(
            ArgSpec(p.name.text, "any", p.default if p.default is not None else REQUIRED) for p in block.params
        )
        written: dict[str, str] = {}
        bound = bind_arguments(
            specs,
            call,
            scope,
            f"block `{name}`",
            self.header.inputs,
            self.diags,
            globals_=self.header.constants,
            spellings=self.spellings[-1],
            written=written,
        )
        if bound is None:
            flow.type = UNKNOWN
            return None
        # A block's arguments are scalars (`_arg_value` of type "any" evaluates to one).
        inner: Scope = {**self.header.constants, **cast(Scope, bound)}
        x = flow.type
        self.block_stack.append(name)
        self.spellings.append({**self.spellings[0], **written})
        self.depth += 1
        first = len(self.diags.items)
        body = self._seq(block.body, flow, inner, path + ".", name_statements(block.body, self.diags))
        self._point_at_use(first, call, name)
        self.depth -= 1
        self.spellings.pop()
        self.block_stack.pop()
        remat = resolve_checkpoint(block, body, path, self.diags)
        return ir.Block(path, name, remat, tuple(body), x, flow.type, call.span)

    def _point_at_use(self, first: int, call: ast.Call, name: str) -> None:
        """Label the mistakes found in a block's body with the use that led to them: the
        body's text is shared by every use, and the arguments of this one may be the cause."""
        use = Label(call.span, f"in this use of `{name}`")
        items = self.diags.items
        items[first:] = [d if d.span == call.span else replace(d, labels=(*d.labels, use)) for d in items[first:]]


def _branch_runs(stmts: Sequence[ast.Stmt]) -> list[ast.Stmt | tuple[ast.BranchStmt, ...]]:
    """The statements with each run of consecutive `branch` statements gathered into one."""
    out: list[ast.Stmt | tuple[ast.BranchStmt, ...]] = []
    for stmt in stmts:
        if isinstance(stmt, ast.BranchStmt) and out and isinstance(out[-1], tuple):
            out[-1] = (*out[-1], stmt)
        elif isinstance(stmt, ast.BranchStmt):
            out.append((stmt,))
        else:
            out.append(stmt)
    return out
