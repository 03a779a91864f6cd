"""The spec's optimizer as an optax transformation."""

from __future__ import annotations

import optax

from dslc.ir.nodes import Optimizer

DEFAULTS = {"lr": 1e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9, "warmup": 0.0}


def learning_rate(opt: Optimizer) -> optax.Schedule:
    """Linear warm-up to `lr`, then constant, or cosine decay to lr/10 over `decay_steps`."""
    h = {**DEFAULTS, **dict(opt.hyper)}
    lr, warmup = h["lr"], int(h["warmup"])
    if "decay_steps" in h:
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(int(h["decay_steps"]), warmup + 1), end_value=lr / 10
        )
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])


def make_optimizer(opt: Optimizer) -> optax.GradientTransformation:
    h = {**DEFAULTS, **dict(opt.hyper)}
    lr = learning_rate(opt)
    match opt.name:
        case "adamw":
            core = optax.adamw(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"])
        case "adam":
            core = optax.adam(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"])
        case "sgd":
            core = optax.sgd(lr, momentum=h["momentum"])
        case other:
            raise AssertionError(f"optimizer {other!r} passed the checker but has no lowering")
    if "clip" in h:
        return optax.chain(optax.clip_by_global_norm(h["clip"]), core)
    return core
