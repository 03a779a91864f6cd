"""How a family of checkpoints lines up with a spec: the order of its layers, the facts both
state (checked against each other before a tensor is read), and where each tensor goes.

A family is recognised in a spec by the order of its layers, not by their names: the labels
are the spec author's. `match` walks the checked IR (residual branches and the arms of
`branch` statements marked, blocks and repeats unrolled, dropout left out as it holds no
weights, each `stream` one mark of its own) against the family's `Structure`. A family
without streams finds a spec with one out of place there; an encoder-decoder (T5) matches
each stream's body on its own (`match_nodes`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dslc.diagnostics import Diagnostic, Label, Span, error
from dslc.frontend import Analysis
from dslc.interop.errors import CheckpointError, file_span
from dslc.ir import nodes as ir
from dslc.layers import LOSS_KINDS, args
from dslc.layers.attention import Attention, AttentionArgs
from dslc.layers.dense import Embed, Linear
from dslc.layers.norm import LayerNorm
from dslc.syntax import ast

OPEN, CLOSE = "(", ")"  # a residual branch begins and ends
# A `stream` statement, whole: its layers are another sequence than the body's, which only a
# family that maps streams matches (on their own).
STREAM = "stream"
# One `branch { }` begins and ends: an arm of consecutive branches, which read the same input
# and whose outputs are summed (GPT-NeoX's attention and MLP side by side).
ARM_OPEN, ARM_CLOSE = "[", "]"

# How the spec's text writes each mark, and how a diagnostic names it.
_WRITTEN = {OPEN: "residual {", ARM_OPEN: "branch {", CLOSE: "}", ARM_CLOSE: "}"}
_NAMED = {
    OPEN: "a residual branch",
    CLOSE: "the end of a residual branch",
    ARM_OPEN: "a `branch`",
    ARM_CLOSE: "the end of a `branch`",
}


@dataclass(frozen=True, slots=True)
class Structure:
    """A family's layers in order: those before the repeated block, one block (with its
    residual branches marked by OPEN and CLOSE, and the arms of its `branch`es by ARM_OPEN
    and ARM_CLOSE), those after."""

    family: str
    prefix: tuple[str, ...]
    block: tuple[str, ...]
    suffix: tuple[str, ...]
    # What the note of a C002 calls these layers: the family ("a T5") unless they are one
    # part of it (T5's encoder, a stream of its own).
    whole: str | None = None

    def describe(self) -> str:
        def words(kinds: tuple[str, ...]) -> str:
            text = " ".join(_WRITTEN.get(k, f"{k},") for k in kinds)
            return text.replace(", }", " }").rstrip(",")

        return f"{words(self.prefix)}, then blocks of {words(self.block)}, then {words(self.suffix)}"


@dataclass(frozen=True, slots=True)
class Matched:
    """The spec's layers with weights or settings the family has, in the family's order."""

    prefix: tuple[ir.Layer, ...]
    blocks: tuple[tuple[ir.Layer, ...], ...]
    suffix: tuple[ir.Layer, ...]


class Token(NamedTuple):
    """A layer of the spec (its kind), or a mark where a residual branch or a `branch`
    begins or ends; `span` is where the text writes it."""

    kind: str
    node: ir.Node
    span: Span


def _tokens(nodes: Sequence[ir.Node]) -> list[Token]:
    out: list[Token] = []
    for node in nodes:
        match node:
            case ir.Layer(kind=kind) if kind == "dropout" or kind in LOSS_KINDS:
                pass
            case ir.Layer(kind=kind):
                out.append(Token(kind, node, node.span))
            case ir.Residual(body=body):
                out += [Token(OPEN, node, node.span), *_tokens(body), Token(CLOSE, node, node.span)]
            case ir.Branches(arms=arms):
                spans = node.arm_spans or (node.span,) * len(arms)
                for arm, span in zip(arms, spans, strict=True):
                    out += [Token(ARM_OPEN, node, span), *_tokens(arm), Token(ARM_CLOSE, node, span)]
            case ir.Block(body=body):
                out += _tokens(body)
            case ir.Stream():
                out.append(Token(STREAM, node, node.span))
            case ir.Layout():
                pass
    return out


def match(structure: Structure, program: ir.Program) -> Matched:
    """The spec's layers in the family's order; a CheckpointError (C002) at the first one out
    of place."""
    return match_nodes(structure, ir.unrolled(program.nodes), forward_end(program))


def forward_end(program: ir.Program) -> Span:
    """Where a diagnostic about a layer missing at the end of `forward` points."""
    return program.chunks[-1].nodes[-1].span if program.chunks[-1].nodes else program.span


def match_nodes(
    structure: Structure, nodes: Sequence[ir.Node], end: Span, ending: str = "the end of `forward`"
) -> Matched:
    """`nodes` (unrolled) in the family's order, as `match`; `ending` is what a diagnostic
    calls their end (a stream's, for a stream's body), `end` where it points at it."""
    tokens = _tokens(nodes)
    at = 0

    def take(kinds: tuple[str, ...]) -> tuple[ir.Layer, ...]:
        nonlocal at
        taken = []
        for kind in kinds:
            found = tokens[at] if at < len(tokens) else None
            if found is None or found.kind != kind:
                raise CheckpointError([_out_of_place(structure, kind, found, end, ending)])
            if isinstance(found.node, ir.Layer):
                taken.append(found.node)
            at += 1
        return tuple(taken)

    prefix = take(structure.prefix)
    blocks: list[tuple[ir.Layer, ...]] = []
    while len(tokens) - at > len(structure.suffix) or not blocks:
        blocks.append(take(structure.block))
    suffix = take(structure.suffix)
    if at < len(tokens):
        raise CheckpointError([_out_of_place(structure, ending, tokens[at], end, ending)])
    return Matched(prefix, tuple(blocks), suffix)


def _out_of_place(structure: Structure, wanted: str, found: Token | None, end: Span, ending: str) -> Diagnostic:
    shown = wanted if wanted == ending else _NAMED.get(wanted, f"`{wanted}`")
    if found is None:
        what, span = ending, end
    elif found.kind == STREAM:
        what, span = f"the stream `{found.node.path}`", found.span
    else:
        what, span = _NAMED.get(found.kind, f"`{found.kind}` `{found.node.path}`"), found.span
    return error(
        "C002",
        f"the spec is not built like a {structure.family}: {shown} should come here, not {what}",
        span,
        notes=[f"{structure.whole or 'a ' + structure.family} is {structure.describe()} (dropout anywhere)"],
    )


# ---- what the config and the spec must agree on -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fact:
    """One size or setting that config.json and the spec both state.

    `constant` is the spec constant that holds it by the family specs' convention: where the
    spec declares it with the value in question, the diagnostic points at it and `--set` fixes
    it; otherwise it points at `layer`, and `fix` says what to write there. `config` is the
    value in the constant's terms, which `--set` gives it; `stated`, where the key says it
    in other terms (GPT-NeoX's `rotary_pct`, a share of each head, for the number of
    features `rope_dims` counts), is how the message quotes the config."""

    key: str
    config: object
    spec: object
    what: str
    layer: ir.Layer
    constant: str | None
    fix: str
    stated: str | None = None


@dataclass(frozen=True, slots=True)
class Requirement:
    """What every checkpoint of the family has, so the spec must have it too (C002)."""

    layer: ir.Layer
    holds: bool
    message: str
    fix: str


def with_biases(layers: Sequence[ir.Layer], what: str) -> list[Requirement]:
    """A requirement that each of `layers` (linears or layernorms, whose bias is `bias=`)
    adds a bias, as every checkpoint of the family has: `what` names them in the message."""
    return [Requirement(layer, _biased(layer), f"its {what} have biases", "write `bias=true`") for layer in layers]


def _biased(layer: ir.Layer) -> bool:
    return bool(args(layer, Linear).bias if layer.kind == Linear.kind else args(layer, LayerNorm).bias)


@dataclass(frozen=True, slots=True)
class Disagreement:
    """A config key the spec disagrees with: the first fact that says so, how many layers do
    (one layer may state a key twice: a ViT's conv its patch as kernel and stride), and the
    `--set` that fixes it (the constant and the config's value) where the spec declares a
    constant that holds it; None where only an edit of the spec does (`fact.fix`)."""

    fact: Fact
    count: int
    setting: tuple[str, object] | None


def disagreeing(facts: Sequence[Fact], analysis: Analysis) -> list[Disagreement]:
    """The config keys the spec disagrees with, once per key, in the order of `facts`."""
    program = analysis.program
    assert program is not None
    constants = dict(program.constants)
    declared = declared_constants(analysis)
    out: list[Disagreement] = []
    for key in dict.fromkeys(f.key for f in facts):
        wrong = [f for f in facts if f.key == key and not same(f.config, f.spec)]
        if not wrong:
            continue
        f = wrong[0]
        # A `--set` fixes it where the constant is declared and is what gives the spec its value.
        settable = f.constant is not None and f.constant in declared and same(constants.get(f.constant), f.spec)
        layers = len({w.layer.path for w in wrong})
        out.append(Disagreement(f, layers, (f.constant, f.config) if settable and f.constant is not None else None))
    return out


def disagreements(
    found: Sequence[Disagreement], analysis: Analysis, config: Path, follows: Mapping[str, str] | None = None
) -> list[Diagnostic]:
    """A C001 for each disagreement: at the constant that holds it with the `--set` that fixes
    it, or else at the layer with the edit that does. A key in `follows` is one that other
    suggested `--set`s fix (named there): it is reported, with no fix of its own."""
    declared = declared_constants(analysis)
    out: list[Diagnostic] = []
    for found_one in found:
        f = found_one.fact
        stated = f.stated if f.stated is not None else _json(f.config)
        message = f"config.json's `{f.key}` is {stated}, but the spec's {f.what} {_is(f.spec)}"
        notes = [f"in {config}"]
        if found_one.count > 1:
            notes.append(f"{found_one.count} layers of the spec disagree with it")
        fixed_by = (follows or {}).get(f.key)
        if fixed_by is not None:
            notes.append(f"`{fixed_by}` {'fix' if fixed_by.count('--set') > 1 else 'fixes'} this too")
        if found_one.setting is not None:
            name, value = found_one.setting
            decl = declared[name]
            written = decl.value
            if isinstance(written, ast.IntLit | ast.FloatLit | ast.BoolLit) and not same(written.value, f.spec):
                notes.append(f"`{name}` is {_json(f.spec)} here, set on the command line")
            out.append(
                error(
                    "C001",
                    message,
                    decl.span,
                    labels=[Label(f.layer.span, f"used by `{f.layer.path}`")],
                    notes=notes,
                    help=None if fixed_by is not None else set_flag(name, value),
                )
            )
        else:
            out.append(error("C001", message, f.layer.span, notes=notes, help=None if fixed_by is not None else f.fix))
    return out


def declared_constants(analysis: Analysis) -> dict[str, ast.ConstDecl]:
    """The constants the spec's text declares, by name, in the order it declares them."""
    if analysis.module is None:
        return {}
    return {item.name.text: item for item in analysis.module.items if isinstance(item, ast.ConstDecl)}


def set_flag(name: str, value: object) -> str:
    """The `--set` that gives constant `name` the config's `value`."""
    return f"--set {name}={_json(value)}"


def unmet(requirements: Sequence[Requirement], family: str) -> list[Diagnostic]:
    """A C002 for each requirement the spec breaks (once per place in the text: the blocks of
    a `repeat` share theirs)."""
    out = {
        (r.layer.span, r.message): error(
            "C002", f"the spec is not built like a {family}: {r.message}", r.layer.span, help=r.fix
        )
        for r in requirements
        if not r.holds
    }
    return list(out.values())


def unsupported(config: Path, problems: Sequence[tuple[str, str]]) -> list[Diagnostic]:
    """C003 for each (message, note) the config asks for that dslc does not compute."""
    return [error("C003", message, file_span(config), notes=[note] if note else []) for message, note in problems]


def same(a: object, b: object) -> bool:
    """Whether the config's value and the spec's are the same (1 and 1.0 are; true and 1 are not)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return a == b


def _json(value: object) -> str:
    return json.dumps(value)


def _is(value: object) -> str:
    if isinstance(value, bool):
        return "is true" if value else "is false"
    return f"is {_json(value)}"


# ---- where each tensor goes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorMap:
    """One tensor of the checkpoint (its name as `save_pretrained` writes it) and the spec's
    weights it holds: side by side along its last dimension when there are several (GPT-2's
    fused q, k, v), or with `heads`, interleaved along it head by head — head 0's slice of
    every part, then head 1's, ... (GPT-NeoX's fused q, k, v, [heads, 3, head_dim]); stored
    [out, in] where the spec's are [in, out] when `transposed`, with its axes in the order
    `axes` gives where the checkpoint orders more than two otherwise (a Conv2d's kernel), and
    `ones` leading axes of size 1 the spec's weight has not (ViT's class token, [1, 1, d]);
    with `index`, the one weight's slice at that index of its first dimension (one expert of
    a mixture's stacked [experts, ...] matrices)."""

    name: str
    parts: tuple[str, ...]
    transposed: bool = False
    # A projection's matrix: one a checkpoint in another layout convention stores turned
    # (embedding tables are [vocab, d] in every convention).
    kernel: bool = False
    index: int | None = None
    heads: int | None = None
    # The checkpoint's axes as the spec's axes they are: a Conv2d's kernel [out, in, kh, kw]
    # is the spec's [kh, kw, in, out] taken in the order (3, 2, 0, 1). Not a reversal, which
    # `transposed` is: that would swap the window's height and width.
    axes: tuple[int, ...] | None = None
    ones: int = 0

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the checkpoint stores a tensor the spec lays out as `shape` in."""
        if self.transposed:
            shape = shape[::-1]
        if self.axes is not None:
            shape = tuple(shape[a] for a in self.axes)
        return (1,) * self.ones + tuple(shape)

    def to_checkpoint(self, tensor: np.ndarray) -> np.ndarray:
        """A tensor as the spec lays it out, in the checkpoint's layout."""
        if self.transposed:
            tensor = tensor.T
        if self.axes is not None:
            tensor = tensor.transpose(self.axes)
        return tensor.reshape((1,) * self.ones + tensor.shape) if self.ones else tensor

    def to_spec(self, tensor: np.ndarray) -> np.ndarray:
        """A tensor as the checkpoint stores it, in the spec's layout: `to_checkpoint` undone."""
        if self.ones:
            tensor = tensor.reshape(tensor.shape[self.ones :])
        if self.axes is not None:
            tensor = tensor.transpose(np.argsort(self.axes))
        return tensor.T if self.transposed else tensor

    def split(self, tensor: np.ndarray, widths: Sequence[int]) -> list[np.ndarray]:
        """The parts of `tensor` (as the spec lays it out, [..., sum of widths]), each of its
        width along the last dimension."""
        if self.heads is None:
            return np.split(tensor, np.cumsum(widths)[:-1], axis=-1)
        lead = tensor.shape[:-1]
        per_head = tensor.reshape(*lead, self.heads, -1)
        cuts = np.cumsum([w // self.heads for w in widths])[:-1]
        return [part.reshape(*lead, -1) for part in np.split(per_head, cuts, axis=-1)]

    def join(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The tensor `split` takes apart: the parts side by side, or interleaved head by head."""
        if len(parts) == 1:
            return parts[0]
        if self.heads is None:
            return np.concatenate(parts, axis=-1)
        joined = np.concatenate([p.reshape(*p.shape[:-1], self.heads, -1) for p in parts], axis=-1)
        return joined.reshape(*joined.shape[:-2], -1)


def layer_weight(layer: ir.Layer, name: str) -> str:
    """A weight's dotted name, as `ir.weights_by_path` has it."""
    return f"{layer.path}.{name}"


def constant(program: ir.Program, name: str, default: object) -> object:
    return dict(program.constants).get(name, default)


def _default_scale(a: AttentionArgs) -> bool:
    """Whether an attention's `scale` is the default 1/sqrt(head_dim), written or not (an
    explicit 0.125 for heads of 64 is; within 1e-9, as the float written rounds)."""
    return a.scale is None or math.isclose(a.scale, a.head_dim**-0.5, rel_tol=1e-9)


# The attention arguments that change what the layer computes beyond the families' common
# attention, by name: whether a layer's arguments take it, the requirement that they do not,
# and the fix.
ATTENTION_ARGUMENTS: dict[str, tuple[Callable[[AttentionArgs], bool], str, str]] = {
    "memory": (
        lambda a: a.memory is not None,
        "its attention computes its keys and values from its own input (no cross-attention)",
        "leave out `memory`",
    ),
    "position_bias": (
        lambda a: a.position_bias is not None,
        "its attention adds no position bias to its scores",
        "leave out `position_bias`",
    ),
    "scale": (
        lambda a: not _default_scale(a),
        "its attention scales its scores by 1/sqrt(head_dim)",
        "leave out `scale`",
    ),
    "qk_norm": (lambda a: bool(a.qk_norm), "its attention does not normalise queries and keys", "leave out `qk_norm`"),
    "window": (lambda a: a.window is not None, "its attention has no sliding window", "leave out `window`"),
    "softcap": (lambda a: a.softcap is not None, "its attention scores are not capped", "leave out `softcap`"),
}


class FamilyBase:
    """What the families share. Their tensors are named `save_pretrained`'s way, the body's
    under `prefix` (which older checkpoints leave out) and the head's weight beside it, as
    `head_tensor`; `buffer` matches the buffers older checkpoints carry, which dslc computes
    itself. The spec has an embedding first and a head last (or before the layers without
    weights that end it: `head_at`), which a checkpoint ties (`tie_word_embeddings`) or not:
    tied where the spec ties them itself (`tie kernel = wte.table.T`, one weight), or else
    where the spec's `tied` constant says so, or the family's default (a head of its own
    holding a copy of the table)."""

    prefix: str
    buffer: re.Pattern[str]
    tied_by_default: bool
    head_tensor: str = "lm_head.weight"  # GPT-NeoX's is `embed_out.weight`
    # Where the head is among the layers after the blocks: the last one, or before those that
    # follow it without weights (Gemma 2's cap on the logits).
    head_at: int = -1
    # Keys of a config.json the spec determines that `config` may not write: other names for
    # the sizes it writes, settings it writes for some model types only.
    determined: frozenset[str] = frozenset()
    # The attention arguments only some models' attention takes (`ATTENTION_ARGUMENTS`) that
    # the family maps onto its config: a spec whose attention takes another computes what no
    # checkpoint of the family does, and `unmapped_attention` refuses it.
    attention_arguments: frozenset[str] = frozenset()
    structure: Structure

    def match(self, program: ir.Program) -> Matched:
        """The spec's layers in the family's order (C002 where they are not)."""
        return match(self.structure, program)

    def unmapped_attention(self, m: Matched) -> list[Requirement]:
        """A C002 for each attention layer that takes an argument of `ATTENTION_ARGUMENTS` the
        family does not map (a Llama spec with T5's `scale=1.0` would import the weights and
        compute other logits)."""
        out = []
        for layer in (*m.prefix, *(layer for block in m.blocks for layer in block), *m.suffix):
            if layer.kind != "attention":
                continue
            a = args(layer, Attention)
            for name, (takes, message, fix) in ATTENTION_ARGUMENTS.items():
                if name not in self.attention_arguments:
                    out.append(Requirement(layer, not takes(a), message, fix))
        return out

    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]:
        """config.json for export: each size and setting the spec determines as `written`
        says, and every other field of the `original` config.json the weights were imported
        from (dslc/interop/remembered.py), in the original's order."""
        out: dict[str, object] = {}
        for key, value in original.items():
            if key in written:
                out[key] = written[key]
            elif key == "dtype":  # what newer transformers call `torch_dtype`
                out[key] = written["torch_dtype"]
            elif key not in self.determined:
                out[key] = value
        return out | {key: value for key, value in written.items() if key not in out}

    def keep_rotary(
        self,
        out: dict[str, object],
        written: Mapping[str, object],
        original: Mapping[str, object],
        rotary: Mapping[str, str],
    ) -> dict[str, object]:
        """`out`, as `keep` gives it for a model with rotary embeddings, with the original's
        `max_position_embeddings` where it is longer than the spec's sequence: the spec was
        run shorter than the model can go, which leaves the model as long as it was (rotary
        embeddings learn nothing per position). `rotary` names the rotary settings other
        transformers versions keep under other keys (the key -> the written key that holds
        the spec's value): where the original has one, at the top or in transformers 5's
        `rope_parameters`, it is the spec's."""
        longest, seq = original.get("max_position_embeddings"), written["max_position_embeddings"]
        if isinstance(longest, int) and isinstance(seq, int) and not isinstance(longest, bool) and longest > seq:
            out["max_position_embeddings"] = longest
        for key, source in rotary.items():
            if key in out:
                out[key] = written[source]
        rope = original.get("rope_parameters")
        if isinstance(rope, dict):
            out["rope_parameters"] = rope | {key: written[source] for key, source in rotary.items() if key in rope}
        return out

    def canonical(self, name: str) -> str:
        """The name `save_pretrained` gives a tensor."""
        return name if name.startswith(self.prefix) or name == self.head_tensor else self.prefix + name

    def ignored(self, name: str) -> bool:
        return self.buffer.fullmatch(name) is not None

    def copies(self, name: str) -> tuple[str, ...]:
        """The other names a checkpoint may store the tensor `name` under as well, each the
        same tensor (none: T5's one token table has three)."""
        return ()

    def head_layer(self, m: Matched) -> ir.Layer:
        return m.suffix[self.head_at]

    def vocab_facts(self, vocab_size: int, m: Matched) -> list[Fact]:
        """The vocabulary: the embedding's and the head's outputs."""
        embed, head = m.prefix[0], self.head_layer(m)
        return [
            Fact(
                "vocab_size", vocab_size, args(embed, Embed).vocab, "vocabulary size", embed, "vocab", "change `vocab`"
            ),
            Fact(
                "vocab_size",
                vocab_size,
                args(head, Linear).out,
                "number of head outputs",
                head,
                "vocab",
                "change `out`",
            ),
        ]

    def head_has_no_bias(self, m: Matched) -> Requirement:
        head = self.head_layer(m)
        return Requirement(head, not args(head, Linear).bias, "its head has no bias", "write `bias=false` on the head")

    def ties(self, m: Matched) -> bool:
        """Whether the spec's head reads the embedding's table itself: one weight, not a copy."""
        tie = self.head_layer(m).weight("kernel").tie
        return tie is not None and tie.transposed and tie.name == layer_weight(m.prefix[0], "table")

    def tied(self, m: Matched, program: ir.Program) -> bool:
        """Whether the checkpoint's head is its embedding (see the class)."""
        return self.ties(m) or bool(constant(program, "tied", self.tied_by_default))

    def head_and_table(self, m: Matched) -> tuple[str, str]:
        """The head's kernel and the embedding's table, by their dotted names."""
        return layer_weight(self.head_layer(m), "kernel"), layer_weight(m.prefix[0], "table")

    def head(self, m: Matched) -> TensorMap:
        """The head's tensor of an untied checkpoint: the head's kernel turned, or for a spec
        whose head reads the embedding's table, that table (as [vocab, d] either way)."""
        if self.ties(m):
            return TensorMap(self.head_tensor, (layer_weight(m.prefix[0], "table"),))
        return TensorMap(self.head_tensor, (layer_weight(self.head_layer(m), "kernel"),), transposed=True, kernel=True)

    def tied_fact(self, tie_word_embeddings: bool, m: Matched, program: ir.Program) -> Fact:
        if self.ties(m):
            return Fact(
                "tie_word_embeddings",
                tie_word_embeddings,
                True,
                "head, which reads the embedding's table (`tie`),",
                self.head_layer(m),
                None,
                "give the head a kernel of its own: drop its `tie`",
            )
        return Fact(
            "tie_word_embeddings",
            tie_word_embeddings,
            self.tied(m, program),
            "tying of the head to the embedding (`const tied`, or the family's default)",
            self.head_layer(m),
            "tied",
            f"declare `const tied = {'true' if tie_word_embeddings else 'false'}`",
        )
