"""What a training step reports besides its loss: plain functions a generated module and `dslc train` call."""

from __future__ import annotations

from typing import Any

import jax
import optax

# The weight of a mixture of experts' balancing bias, whose "gradient" is its excess load,
# not a gradient of the loss: left out of the gradient norm.
BALANCE_BIAS = "balance_bias"


def step_metrics(grads: Any) -> dict[str, jax.Array]:
    """The figures of one optimizer step worth logging: the global L2 norm of its gradients
    (before any clipping), which spikes before a loss diverges."""
    if isinstance(grads, dict):
        grads = {name: g for name, g in grads.items() if not name.endswith(BALANCE_BIAS)}
    return {"grad_norm": optax.tree.norm(grads)}


def moe_metrics(aux: dict[str, float]) -> dict[str, float]:
    """A mixture of experts' health from the layers' auxiliary values (summed over them):
    `moe_balance_loss`, the load-balancing loss the experts add to the training loss (the
    router's load: lowest when every expert receives its share); `moe_z_loss`, the router
    z-loss added likewise; `moe_dropped_fraction`, the share of token-to-expert choices
    dropped for want of capacity (0 dropless); `moe_load_max`, the busiest expert's choices
    over the mean, averaged over the layers (1 when every expert gets its share). Empty
    without a mixture of experts."""
    if "moe_routed" not in aux:
        return {}
    z = float(aux.get("moe_z_loss", 0.0))
    return {
        "moe_balance_loss": float(aux.get("aux_loss", 0.0)) - z,
        "moe_z_loss": z,
        "moe_dropped_fraction": float(aux["moe_dropped"]) / max(float(aux["moe_routed"]), 1.0),
        "moe_load_max": float(aux["moe_load_max"]) / max(float(aux["moe_layers"]), 1.0),
    }
