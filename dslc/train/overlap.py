"""XLA flags that overlap collectives with compute, by backend, set before jax starts.

XLA runs a collective where the program needs its result unless told to start it earlier.
On NVIDIA GPUs its latency-hiding scheduler starts each asynchronous collective as early as
its operands allow and waits for it as late as its users allow; in a scanned layer loop,
the pipelining passes issue the next layer's parameter all-gather (ZeRO-3, FSDP) and the
previous layer's gradient reduction during this layer's compute. On TPUs the same is done by
libtpu's asynchronous collective fusion. The profiles below are what the field runs large
models with: JAX's "GPU performance tips" (its flags for training with collectives),
MaxText's GPU and TPU launch configurations, and NVIDIA's JAX-Toolbox recipes. On CPU, XLA
runs every collective synchronously: there is nothing to set.

A flag the user already set (in `XLA_FLAGS`, or `LIBTPU_INIT_ARGS` for libtpu's) is left as
the user set it. The planner models the same split (`dslc.plan.step_time`): what the
compiled program can hide — ZeRO-3/FSDP's parameter gathers and the gradient reductions XLA
issues layer by layer — and what stays exposed (tensor-parallel collectives, whose results
the next matrix product needs at once; pipeline sends; all-to-alls; the once-per-step sums).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import MutableMapping
from typing import NamedTuple


class Flag(NamedTuple):
    name: str
    value: str
    does: str


# 128 MiB: combine the small collectives of one step up to this size into one call (each call
# pays the network's latency), as JAX's GPU tips and MaxText's GPU configurations do.
_COMBINE = str(128 * 1024 * 1024)

PROFILES: dict[str, tuple[Flag, ...]] = {
    "gpu": (
        Flag(
            "xla_gpu_enable_latency_hiding_scheduler",
            "true",
            "start each asynchronous collective as early as its operands allow, wait as late as its users allow",
        ),
        Flag(
            "xla_gpu_enable_pipelined_all_gather",
            "true",
            "in a scanned layer loop, gather the next layer's parameters (ZeRO-3, FSDP) during this layer",
        ),
        Flag(
            "xla_gpu_enable_pipelined_reduce_scatter",
            "true",
            "likewise, reduce-scatter the previous layer's gradient during this layer",
        ),
        Flag(
            "xla_gpu_enable_pipelined_all_reduce",
            "true",
            "likewise, all-reduce the previous layer's gradient during this layer",
        ),
        Flag(
            "xla_gpu_enable_while_loop_double_buffering",
            "true",
            "unroll the layer loop by two, so a pipelined collective's buffer alternates with the compute's",
        ),
        Flag(
            "xla_gpu_enable_highest_priority_async_stream",
            "true",
            "run collectives on the highest-priority stream, so compute kernels do not hold them back",
        ),
        Flag("xla_gpu_all_reduce_combine_threshold_bytes", _COMBINE, "combine all-reduces up to 128 MiB a call"),
        Flag("xla_gpu_all_gather_combine_threshold_bytes", _COMBINE, "combine all-gathers up to 128 MiB a call"),
        Flag(
            "xla_gpu_reduce_scatter_combine_threshold_bytes", _COMBINE, "combine reduce-scatters up to 128 MiB a call"
        ),
    ),
    "tpu": (
        Flag(
            "xla_tpu_enable_async_collective_fusion",
            "true",
            "run collectives asynchronously, fused with the compute around them",
        ),
        Flag(
            "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
            "true",
            "include all-gathers (ZeRO-3/FSDP's parameter gathers) in that fusion",
        ),
        Flag(
            "xla_tpu_enable_async_collective_fusion_multiple_steps",
            "true",
            "let an asynchronous collective span several steps of compute",
        ),
        Flag("xla_tpu_overlap_compute_collective_tc", "true", "overlap collectives with the TensorCore's compute"),
        Flag("xla_enable_async_all_gather", "true", "issue all-gathers asynchronously"),
        Flag("xla_enable_async_collective_permute", "true", "issue permutations (pipeline sends) asynchronously"),
    ),
}

# Where each backend reads its flags.
VARIABLES = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}


def coming_backend(environ: MutableMapping[str, str]) -> str:
    """The backend jax will start: `JAX_PLATFORMS`'s first entry, else an installed GPU or TPU
    plugin, else cpu. Found without starting jax (the flags must be set before it starts)."""
    named = environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if named:
        return "gpu" if named in ("cuda", "rocm", "gpu") else named
    if _installed("jax_cuda12_plugin") or _installed("jax_plugins.xla_cuda12"):
        return "gpu"
    if _installed("libtpu"):
        return "tpu"
    return "cpu"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package that is not there
        return False


def apply_overlap_flags(environ: MutableMapping[str, str], backend: str | None = None) -> tuple[str, list[Flag]]:
    """Add `backend`'s profile (by default the backend jax will start) to the variable it
    reads, every flag the user has not set already. Returns the backend and the flags added."""
    backend = backend or coming_backend(environ)
    profile = PROFILES.get(backend, ())
    if not profile:
        return backend, []
    variable = VARIABLES[backend]
    current = environ.get(variable, "")
    added = [flag for flag in profile if not re.search(rf"--{flag.name}(=|\s|$)", current)]
    if added:
        words = " ".join(f"--{flag.name}={flag.value}" for flag in added)
        environ[variable] = f"{current} {words}".strip()
    return backend, added
