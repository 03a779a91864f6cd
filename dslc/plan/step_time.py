"""How long one training step takes, on paper: compute, exposed communication and bubble.

The cost model `dslc plan --mesh auto` ranks plans with. Its inputs are the planner's own
figures (FLOPs per device, bytes sent per collective and mesh axes, the schedule's bubble);
its parameters are a few numbers about the hardware (`Hardware`), all overridable:

* compute: FLOPs per device / `device_flops`, an *effective* rate (what a training step
  sustains, well under the datasheet peak);
* communication: for each collective call, a fixed latency plus the bytes one device sends
  over the group / the bandwidth of the link the group spans (the alpha-beta model).
  Devices are numbered node by node, and the mesh axes are laid out innermost first in
  Megatron-LM's order — tensor-like axes (tensor, expert, context), then data, then
  pipeline — so an axis whose groups fit in one node (its size times the sizes of the axes
  inside it is at most `node_size`) uses `intra_bandwidth` and `intra_latency`, and any other
  axis the inter-node pair. A spec that declares which axes cross nodes (`mesh data=16
  across 2 nodes, model=8`) is costed on that layout instead, the one its mesh is built
  with. The latency is what makes slicing the batch finer cost something: every
  microbatch runs each layer's collectives, and every pipeline tick sends.
  Where the compiled program overlaps collectives with compute (`Hardware.overlap`: the GPU
  and TPU flag profiles of `dslc.train.overlap`, which `dslc train` sets), the transfers it
  can run under compute (`Transfer.hideable`: ZeRO-3/FSDP's parameter gathers, the gradient
  reductions XLA issues layer by layer) are hidden, up to the compute time they run under;
  the rest is exposed. Without overlap (XLA's CPU backend runs every collective where its
  result is needed) all of it is exposed. The gradient reductions, independent of one
  another, are combined into one call per kind and axes, as XLA's combiner passes do;
* bubble: the per-microbatch work (compute and layer collectives) stretched by the schedule's
  bubble fraction b (idle over the makespan): bubble time = work · b / (1 − b). Pipeline sends
  happen every tick, idle ones included, so they are not stretched again; nor are the
  once-per-step gradient reductions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dslc.ir.nodes import Mesh
from dslc.plan.communication import Transfer

# Phases whose collectives run inside each microbatch's forward and backward passes: the
# schedule's idle ticks stretch them along with the compute.
PER_MICROBATCH = ("forward", "backward", "recompute")


@dataclass(frozen=True, slots=True)
class Hardware:
    """The machine a plan is costed on. Defaults: an A100/H100-class device at a realistic
    training throughput, NVLink inside an 8-device node, 200 Gb/s InfiniBand between nodes;
    the latencies are the order of a small collective's on such links (assumed, not measured
    here)."""

    device_flops: float = 300e12  # FLOP/s one device sustains
    intra_bandwidth: float = 300e9  # bytes/s one device sends to another in its node
    inter_bandwidth: float = 25e9  # bytes/s one device sends to a device in another node
    node_size: int = 8  # devices per node
    intra_latency: float = 10e-6  # seconds a collective call costs inside a node, whatever its size
    inter_latency: float = 20e-6  # likewise between nodes
    overlap: bool = True  # the compiled program runs hideable collectives under compute

    def to_json(self) -> dict[str, float | bool]:
        return {
            "device_flops": self.device_flops,
            "intra_bandwidth": self.intra_bandwidth,
            "inter_bandwidth": self.inter_bandwidth,
            "node_size": self.node_size,
            "intra_latency": self.intra_latency,
            "inter_latency": self.inter_latency,
            "overlap": self.overlap,
        }

    def describe(self) -> str:
        return (
            f"{self.device_flops / 1e12:g} TFLOP/s per device, {self.intra_bandwidth / 1e9:g} GB/s and "
            f"{self.intra_latency * 1e6:g} µs per call inside a node of {self.node_size}, "
            f"{self.inter_bandwidth / 1e9:g} GB/s and {self.inter_latency * 1e6:g} µs between nodes"
            + ("" if self.overlap else ", no collective overlapped with compute")
        )


@dataclass(frozen=True, slots=True)
class StepTime:
    """Seconds per training step, by where they go."""

    compute: float
    communication: float  # exposed: the step waits for it
    bubble: float
    hidden: float = 0.0  # communication that runs under the compute (not in the total)

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble


def node_local_axes(mesh: Mesh, axes: Sequence[tuple[str, int]], node_size: int) -> frozenset[str]:
    """The axes whose groups stay inside one node: when the spec says which axes cross nodes
    (`across N nodes`, the layout the mesh is built with), all the others; otherwise those
    Megatron's layout keeps inside (`intra_node_axes`)."""
    if mesh.nodes > 1:
        return frozenset(a.name for a in mesh.axes if a.nodes == 1)
    return intra_node_axes(axes, node_size)


def intra_node_axes(axes: Sequence[tuple[str, int]], node_size: int) -> frozenset[str]:
    """The axes whose groups stay inside one node, `axes` being (name, size) innermost first."""
    inside, span = set(), 1
    for name, size in axes:
        span *= size
        if span > node_size:
            break
        inside.add(name)
    return frozenset(inside)


def step_time(
    flops_per_device: float,
    transfers: Iterable[Transfer],
    bubble_fraction: float,
    intra: frozenset[str],
    hardware: Hardware,
) -> StepTime:
    """The step time of a device doing `flops_per_device` and sending `transfers`, under a
    schedule that idles `bubble_fraction` of its makespan."""
    compute = flops_per_device / hardware.device_flops
    in_microbatches = other = hideable = 0.0
    for t in transfers:
        inside = set(t.axes) <= intra
        bandwidth = hardware.intra_bandwidth if inside else hardware.inter_bandwidth
        latency = hardware.intra_latency if inside else hardware.inter_latency
        seconds = _calls(t) * latency + t.bytes / bandwidth
        if t.hideable and hardware.overlap:
            hideable += seconds
        elif t.phase in PER_MICROBATCH:
            in_microbatches += seconds
        else:
            other += seconds
    hidden = min(hideable, compute)
    bubble = (compute + in_microbatches) * bubble_fraction / (1 - bubble_fraction)
    return StepTime(compute, in_microbatches + other + hideable - hidden, bubble, hidden)


def _calls(t: Transfer) -> int:
    """How many separate calls pay the latency: the once-per-step gradient reductions are
    independent of one another, and XLA combines them into one call per kind and axes."""
    return 1 if t.phase == "gradients" else t.count
