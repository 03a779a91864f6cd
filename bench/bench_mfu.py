"""dslc against hand-written JAX: the same Llama-style model trained both ways, MFU side by side.

    .venv/bin/python bench/bench_mfu.py [--steps N] [--device-flops TFLOPS] [--overlap on|off|both]

The model is specs/llama_small.par (RMSNorm, grouped-query attention with rotary positions,
SwiGLU MLP, no biases, untied head) without its activation checkpointing, on one device, at
sizes chosen for the backend: on a CPU d 256, 4 layers, seq 256, batch 8 in f32 (XLA's CPU
backend widens bf16, which would time the widening); on an accelerator d 2048, 8 layers, seq
2048, batch 8 in bf16. The hand-written model is what a JAX user writes for it: a dict of
arrays, a Python loop over the layers, `jax.nn.dot_product_attention` (the fused kernel where
the backend has one), optax's AdamW, one `jax.jit`ted step with its state donated. Both
start from the same weights (dslc's initialisation, read out by name) and train on the same
random batch.

Printed for each: the median step time after two warm-up steps (the two taking turns, a step
each, `--steps` rounds), model TFLOP/s per device
and MFU, both from the planner's count of the model's FLOPs (forward and backward, the
figure `dslc train` reports) against the device's dense peak (dslc.train.utilization; none
on a CPU, so MFU there is "n/a" unless --device-flops gives a peak), the first step's loss
(equal when the two are the same model) and the last, and dslc's MFU (or throughput) over
the hand-written one's. It prints figures and
asserts nothing (tests/train/test_train.py checks the FLOPs and MFU that `dslc train` logs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import dslc
from dslc.plan.flops import flops
from dslc.train.overlap import apply_overlap_flags
from dslc.train.utilization import peak_for

SPEC = Path(__file__).resolve().parent.parent / "specs" / "llama_small.par"
SIZES = {
    "cpu": (
        {"vocab": 512, "d": 256, "heads": 8, "kv_heads": 4, "ffn": 688, "seq": 256, "batch": 8, "n_layers": 4},
        "f32",
    ),
    "accelerator": (
        {"vocab": 32768, "d": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632, "seq": 2048, "batch": 8, "n_layers": 8},
        "bf16",
    ),
}
EPS = 1e-6  # dslc's rmsnorm epsilon
LR = 1e-3


def rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary positions over [batch, seq, heads, head_dim], the two halves rotated as pairs."""
    s, hd = x.shape[1], x.shape[3]
    inv = 1.0 / base ** (jnp.arange(0, hd // 2, dtype=jnp.float32) * 2 / hd)
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    first, second = x[..., : hd // 2].astype(jnp.float32), x[..., hd // 2 :].astype(jnp.float32)
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], -1).astype(x.dtype)


def rmsnorm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS) * scale).astype(x.dtype)


def hand_written_loss(sizes: dict[str, int], dtype: Any) -> Callable[[dict[str, jax.Array], jax.Array, jax.Array], Any]:
    h, kv, d = sizes["heads"], sizes["kv_heads"], sizes["d"]
    hd = d // h

    def loss(p: dict[str, jax.Array], tokens: jax.Array, targets: jax.Array) -> jax.Array:
        w = {k: v.astype(dtype) for k, v in p.items()}
        x = w["embed.table"][tokens]
        b, s = tokens.shape
        for i in range(sizes["n_layers"]):
            name = f"layers.{i}"
            y = rmsnorm(x, p[f"{name}.attn_norm.scale"])
            q = rope((y @ w[f"{name}.attn.q"]).reshape(b, s, h, hd))
            k = rope((y @ w[f"{name}.attn.k"]).reshape(b, s, kv, hd))
            v = (y @ w[f"{name}.attn.v"]).reshape(b, s, kv, hd)
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
            x = x + o @ w[f"{name}.attn.o"]
            y = rmsnorm(x, p[f"{name}.mlp_norm.scale"])
            gated = jax.nn.silu(y @ w[f"{name}.gate_up.gate"]) * (y @ w[f"{name}.gate_up.up"])
            x = x + gated @ w[f"{name}.down.kernel"]
        logits = (rmsnorm(x, p["norm.scale"]) @ w["head.kernel"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def time_alternating(steps: dict[str, Callable[[], float]], rounds: int) -> dict[str, tuple[float, float, float]]:
    """For each step function: the median seconds per step, its first loss and its last. Two
    warm-up steps each (the first compiles), then the functions take turns, one step each per
    round, so that both see the same machine (a shared one drifts by tens of percent)."""
    first = {name: step() for name, step in steps.items()}
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    last = dict(first)
    for _ in range(rounds):
        for name, step in steps.items():
            began = time.perf_counter()
            last[name] = step()
            times[name].append(time.perf_counter() - began)
    return {name: (statistics.median(times[name]), first[name], last[name]) for name in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed rounds (a step of each per round)")
    parser.add_argument("--device-flops", type=float, help="dense peak TFLOP/s per device (default: the datasheet's)")
    parser.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="on",
        help="dslc train's XLA overlap flags (dslc/train/overlap.py) on, off, or both: one process each, one after "
        "the other, each printing its own table",
    )
    args = parser.parse_args()
    if args.overlap == "both":
        for setting in ("on", "off"):
            print(f"---- XLA overlap flags {setting}", flush=True)
            argv = ["--steps", str(args.steps), "--overlap", setting]
            argv += ["--device-flops", str(args.device_flops)] if args.device_flops is not None else []
            subprocess.run([sys.executable, __file__, *argv], check=True)
        return
    if args.overlap == "on":  # before jax starts its backend, which reads them once
        backend, added = apply_overlap_flags(os.environ)
        print(f"XLA overlap flags for {backend}: {len(added)} set")
    device = jax.devices()[0]
    sizes, dtype_name = SIZES["cpu" if device.platform == "cpu" else "accelerator"]
    text = SPEC.read_text().replace(" checkpoint full", "").replace("compute_dtype bf16", f"compute_dtype {dtype_name}")
    text = text.replace("adamw(lr=1e-3, warmup=50)", "adamw(lr=1e-3)")  # the hand-written one's, below
    program = dslc.compile(text, mesh="1x1", overrides=sizes)
    model = program.init(0)
    weights = program.export_weights(model)
    batch = program.example_batch(0)
    counted = flops(program.ir)
    model_flops = counted.forward + counted.backward
    peak = peak_for(device.device_kind, dtype_name, args.device_flops)
    print(f"llama_small without checkpointing, {sizes}, {dtype_name}, on {device.device_kind}")
    print(f"model FLOPs per step (forward and backward, the planner's count): {model_flops:.4g}")
    print(f"peak: {peak.source if peak else 'none published for this device (--device-flops T gives one)'}")

    state = program.init_optimizer(model)
    index = iter(range(10**9))

    def dslc_step() -> float:
        nonlocal state
        state, figures = program.train_step_with_metrics(model, state, batch, next(index))
        return figures["loss"]

    dtype = jnp.bfloat16 if dtype_name == "bf16" else jnp.float32
    loss_fn = hand_written_loss(sizes, dtype)
    optimizer = optax.adamw(LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)  # dslc's defaults
    params = {name: jnp.asarray(value) for name, value in weights.items()}
    opt_state = optimizer.init(params)
    tokens, targets = jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"])

    def update(p: Any, s: Any, tokens: jax.Array, targets: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens, targets)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    donated = jax.jit(update, donate_argnums=(0, 1))

    def hand_step() -> float:
        nonlocal params, opt_state
        params, opt_state, loss = donated(params, opt_state, tokens, targets)
        return float(loss)

    print(f"{'':<14} {'ms/step':>9} {'TFLOP/s/dev':>12} {'MFU':>7} {'loss 1st':>9} {'last':>8}")
    results = time_alternating({"hand-written": hand_step, "dslc": dslc_step}, args.steps)
    for name, (seconds, first, loss) in results.items():
        tflops = model_flops / seconds / 1e12
        mfu = f"{tflops * 1e12 / peak.flops:.1%}" if peak else "n/a"
        print(f"{name:<14} {seconds * 1e3:>9.1f} {tflops:>12.4g} {mfu:>7} {first:>9.4f} {loss:>8.4f}")
    ratio = results["hand-written"][0] / results["dslc"][0]
    print(f"dslc / hand-written: {ratio:.2f} (MFU, or throughput, ratio)")


if __name__ == "__main__":
    main()
