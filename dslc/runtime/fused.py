"""Which fused attention kernel a backend has for which heads: a pure function, no jax, so
that the runtime chooses with it when it traces and `dslc check` says the same beforehand."""

from __future__ import annotations


def flash_implementation(
    backend: str, dtype: str, head_dim: int, seq: int, segments: bool, softcap: bool = False
) -> tuple[str, str]:
    """Which implementation of the flash algorithm runs on `backend` ("cpu", "gpu", "tpu"),
    for heads of `head_dim` in `dtype` over `seq` tokens (with packed documents, with capped
    scores), and why not a fused one when not: ("cudnn" | "splash" | "blockwise", reason).
    Pure: the checker asks it too."""
    if backend in ("gpu", "cuda"):
        if softcap:
            return "blockwise", "cuDNN's fused attention through jax takes no cap on the scores (softcap)"
        if dtype not in ("bfloat16", "float16"):
            return "blockwise", f"cuDNN's fused attention takes 16-bit heads, these are {dtype}"
        if head_dim > 128 or head_dim % 8:
            return (
                "blockwise",
                f"cuDNN's fused attention takes heads of a width up to 128 in steps of 8, not {head_dim}",
            )
        if segments:
            return "blockwise", "documents packed into one sequence need a mask cuDNN's fused attention does not take"
        return "cudnn", "cuDNN's fused flash attention"
    if backend == "tpu":
        if seq % 128:
            return "blockwise", f"splash attention takes sequences in blocks of 128 tokens, not {seq}"
        return "splash", "Pallas splash attention"
    return "blockwise", f"no fused attention kernel on {backend}"
