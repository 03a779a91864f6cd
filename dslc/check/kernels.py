"""Which kernel each attention layer runs on a backend, said before anything compiles.

The flash algorithm runs a backend's fused kernel where one takes the layer's heads (cuDNN's
on NVIDIA GPUs, splash attention on TPUs) and a blockwise kernel in plain JAX otherwise; the
runtime chooses with the same function (`dslc.runtime.fused.flash_implementation`) when it
traces. `dslc check --backend gpu|tpu|cpu` lists the choices and warns (W005) where a fused
kernel was not possible on an accelerator, with why: a shape or dtype cuDNN does not take is
a check-time warning, never a runtime exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.diagnostics import Diagnostic, warning
from dslc.ir import nodes as ir
from dslc.layers.attention import FLASH_FROM, Attention, algorithm
from dslc.runtime.fused import flash_implementation

BACKENDS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One attention layer's core on a backend: the algorithm, its implementation and why."""

    layer: ir.Layer
    algorithm: str  # "dense", "flash" or "ring"
    implementation: str  # "dense", "cudnn", "splash", "blockwise" or "ring"
    why: str


def attention_kernels(program: ir.Program, backend: str) -> list[KernelChoice]:
    """The core every attention layer of `program` runs on `backend`, in model order (one
    entry per layer of a repeat's body)."""
    rule = Attention()
    dtype = ir.DTYPES[program.train.compute_dtype].jax
    found = []
    for layer in ir.all_layers(program):
        if layer.kind != Attention.kind:
            continue
        a = rule.args_of(layer)
        seq = layer.input.shape[1]
        if layer.operand and layer.operand[1]:
            found.append(KernelChoice(layer, "ring", "ring", "its sequence is split over a context axis"))
            continue
        chosen = algorithm(a, seq)
        if chosen == "dense":
            why = "kernel=dense" if a.kernel == "dense" else f"{seq} tokens, under the {FLASH_FROM} that take flash"
            found.append(KernelChoice(layer, "dense", "dense", why))
            continue
        implementation, why = flash_implementation(
            backend, dtype, a.head_dim, seq, a.segments is not None, a.softcap is not None
        )
        found.append(KernelChoice(layer, "flash", implementation, why))
    return found


def kernel_warnings(program: ir.Program, backend: str) -> list[Diagnostic]:
    """W005 for each attention layer whose flash core cannot run its accelerator's fused kernel."""
    out = []
    for choice in attention_kernels(program, backend):
        if backend == "cpu" or choice.algorithm != "flash" or choice.implementation != "blockwise":
            continue
        fused = "cuDNN's fused attention" if backend == "gpu" else "splash attention"
        out.append(
            warning(
                "W005",
                f"`{choice.layer.path}` runs flash attention as dslc's blockwise kernel on {backend}, not "
                f"{fused}: {choice.why}",
                choice.layer.span,
                notes=["the blockwise kernel keeps no more memory, but runs at the speed of its matrix products"],
                help=_fix(choice.why),
            )
        )
    return out


def _fix(why: str) -> str:
    """What would let the fused kernel take the layer, by the reason it cannot."""
    if "16-bit" in why:
        return "compute in bf16 (`train { compute_dtype bf16 }`)"
    if "width" in why:
        return "choose heads of a width up to 128 in steps of 8 (`head_dim=`)"
    if "packed" in why:
        return "train on sequences that each hold one document, without `segments`"
    return "make the sequence a multiple of 128 tokens"


def describe(choice: KernelChoice) -> str:
    """One line of `dslc check --backend`'s list."""
    names = {
        "dense": "dense",
        "ring": "ring attention",
        "cudnn": "flash, cuDNN's fused kernel",
        "splash": "flash, splash attention",
        "blockwise": "flash, blockwise",
    }
    return f"`{choice.layer.path}`: {names[choice.implementation]} ({choice.why})"
