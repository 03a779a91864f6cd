"""Model FLOPs utilisation (MFU): how close a training step runs to the hardware's limit.

The figure the field reports (PaLM's definition, as MaxText, Levanter and Megatron print
it): the model's FLOPs per step over the step's time, per device, against the device's dense
peak for the step's compute dtype.

* Model FLOPs are the planner's count (`dslc plan`'s "FLOPs per step"): forward plus
  backward, for the whole mesh and the whole global batch. Recomputation (checkpointing, a
  split backward's second pull) is work the hardware does, not work of the model, and is
  left out, so checkpointing lowers MFU. Attention's scores count in full, `seq x seq` per
  head, as the dense kernel computes them; a causal mask's hidden half counts too (Megatron
  counts the same way; a blockwise kernel that skips masked blocks does less than counted).
* The peak is the vendor's datasheet figure for dense products (no structured sparsity) in
  the compute dtype, per device (one GPU; one TPU chip as jax lists it). For f32 on NVIDIA
  GPUs it is the TF32 tensor-core peak, the precision XLA gives f32 products by default; on
  TPUs an f32 product at default precision is one bf16 pass, so the bf16 peak. Where no
  peak is known (CPUs above all), MFU is not reported rather than invented; `--device-flops`
  gives one.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense peak TFLOP/s per device by compute dtype, for `device_kind`s that contain the key
# (first match wins, so the more specific come first), with the name the figure is reported
# under. Sources: NVIDIA's H100, H200 and A100 datasheets; Google Cloud's TPU pages.
_GPU_H100_SXM = {"bf16": 989.0, "f16": 989.0, "f32": 494.5}
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H100 PCIe", "NVIDIA H100 PCIe", {"bf16": 756.0, "f16": 756.0, "f32": 378.0}),
    ("H100", "NVIDIA H100 SXM", _GPU_H100_SXM),
    ("H200", "NVIDIA H200", _GPU_H100_SXM),
    ("A100", "NVIDIA A100", {"bf16": 312.0, "f16": 312.0, "f32": 156.0}),
    ("TPU v4", "TPU v4", {"bf16": 275.0, "f32": 275.0}),
    ("TPU v5 lite", "TPU v5e", {"bf16": 197.0, "f32": 197.0}),
    ("TPU v5", "TPU v5p", {"bf16": 459.0, "f32": 459.0}),
    ("TPU v6 lite", "TPU v6e", {"bf16": 918.0, "f32": 918.0}),
)


@dataclass(frozen=True, slots=True)
class Peak:
    flops: float  # FLOP/s per device
    source: str  # what the figure is, as reported beside MFU


def peak_for(device_kind: str, compute_dtype: str, override_tflops: float | None = None) -> Peak | None:
    """The dense peak MFU is measured against: `override_tflops` (`--device-flops`) when given,
    else the table's for the device and dtype, else None."""
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, f"{override_tflops:g} TFLOP/s per device, from --device-flops")
    for key, name, by_dtype in PEAKS:
        if key in device_kind and compute_dtype in by_dtype:
            tflops = by_dtype[compute_dtype]
            return Peak(tflops * 1e12, f"{tflops:g} TFLOP/s, the {compute_dtype} dense peak of one {name}")
    return None


@dataclass(frozen=True, slots=True)
class Utilization:
    """What a run's steps are measured against: the model's FLOPs per step, the devices
    sharing them, and the peak (None where none is known)."""

    model_flops: int  # per optimizer step, whole mesh
    devices: int
    peak: Peak | None
    device_kind: str

    def tflops_per_device(self, step_time_s: float) -> float:
        return self.model_flops / step_time_s / self.devices / 1e12

    def mfu(self, step_time_s: float) -> float | None:
        return self.tflops_per_device(step_time_s) * 1e12 / self.peak.flops if self.peak is not None else None

    def figures(self, step_time_s: float) -> dict[str, float | None]:
        """The figures of one step that took `step_time_s`, for its metrics row."""
        return {
            "model_flops": float(self.model_flops),
            "tflops_per_device": self.tflops_per_device(step_time_s),
            "mfu": self.mfu(step_time_s),
            "peak_tflops": self.peak.flops / 1e12 if self.peak is not None else None,
        }

    def describe(self, step_time_s: float) -> str:
        """The summary's line for a steady step time."""
        said = f"{self.tflops_per_device(step_time_s):.4g} TFLOP/s per device of model FLOPs ({self.model_flops:.4g}"
        said += " per step: forward and backward, recomputation not counted, attention scores in full)"
        mfu = self.mfu(step_time_s)
        if self.peak is None or mfu is None:
            return said + f"; MFU not reported: no published peak for {self.device_kind} (--device-flops T gives one)"
        return said + f"; MFU {mfu:.1%} of {self.peak.source}"
