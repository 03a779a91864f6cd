"""Resolve checkpoints: a block's `checkpoint` clause as the remat policy of its uses, the
layers `selective(...)` saves named by their resolved paths."""

from __future__ import annotations

from typing import get_args

from dslc.diagnostics import Diagnostics
from dslc.ir import nodes as ir
from dslc.ir.names import unknown_name
from dslc.layers import RULES
from dslc.syntax import ast

CHECKPOINT_POLICIES: tuple[ir.RematPolicy, ...] = get_args(ir.RematPolicy)


def resolve_checkpoint(block: ast.BlockDef, body: list[ir.Node], path: str, diags: Diagnostics) -> ir.Remat:
    """The remat policy of the use of `block` at `path`, whose elaborated layers are `body`."""
    cp = block.checkpoint
    if cp is None:
        return ir.Remat()
    policy = next((p for p in CHECKPOINT_POLICIES if p == cp.policy.text), None)
    if policy is None:
        diags.add(unknown_name("checkpoint policy", cp.policy.text, cp.policy.span, CHECKPOINT_POLICIES, code="E026"))
        return ir.Remat()
    if policy != "selective":
        if cp.saved:
            diags.error(
                "E026",
                f"`checkpoint {policy}` takes no list of saved layers",
                cp.span,
                help=f"use `checkpoint selective({', '.join(i.text for i in cp.saved)})`",
            )
        if policy == "core_attention":
            _has_cores(block, body, cp, diags)
        return ir.Remat(policy)
    inside = [n.path for n in ir.walk(tuple(body)) if isinstance(n, ir.Layer)]
    short = {p.rsplit(".", 1)[-1] for p in inside}
    saved: list[str] = []
    for ident in cp.saved:
        # A name is a layer's path below the block (`mlp.up`) or the last part of it (`up`).
        matches = [p for p in inside if p[len(path) + 1 :] == ident.text or p.rsplit(".", 1)[-1] == ident.text]
        if not matches:
            message = f"block `{block.name.text}` has no layer `{ident.text}` to save"
            diags.add(unknown_name("layer", ident.text, ident.span, short, message=message))
        saved.extend(p for p in matches if p not in saved)
    if not cp.saved:
        diags.error(
            "E026",
            "`checkpoint selective(...)` needs the layers whose outputs are saved",
            cp.span,
            help="for example `checkpoint selective(attn)`",
        )
    return ir.Remat("selective", tuple(saved))


def _has_cores(block: ast.BlockDef, body: list[ir.Node], cp: ast.Checkpoint, diags: Diagnostics) -> None:
    """`checkpoint core_attention` recomputes the cores of the block's own attention layers: a
    block without one is told so."""
    own = ir.own_layers(tuple(body))
    if any(RULES[layer.kind].core_flops(layer) for layer in own):
        return
    why = [note for layer in own if (note := RULES[layer.kind].no_core_note(layer)) is not None]
    diags.error(
        "E026",
        f"block `{block.name.text}` has no attention layer of its own whose core `checkpoint core_attention` "
        "could recompute",
        cp.span,
        notes=why[:1],
        help="use `checkpoint full` or `checkpoint selective(...)`, or put the policy on the block that "
        "holds the attention layer",
    )
