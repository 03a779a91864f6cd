"""The spec's optimizer as an optax transformation (the arithmetic is in dslc.kernels.training)."""

from __future__ import annotations

import optax

from dslc.ir.nodes import Optimizer
from dslc.kernels import training

DEFAULTS = training.OPTIMIZER_DEFAULTS


def learning_rate(opt: Optimizer) -> optax.Schedule:
    return training.learning_rate(dict(opt.hyper))


def make_optimizer(opt: Optimizer) -> optax.GradientTransformation:
    return training.make_optimizer(opt.name, dict(opt.hyper))
