"""Mixture of experts: a router picks top-k experts per token; experts split over an axis."""

from __future__ import annotations

from dslc.diagnostics import Label
from dslc.ir.nodes import Sharding, TensorType
from dslc.layers.base import ArgSpec, Attrs, Context, LayerRule, WeightSpec, expect_features, fmt_axes, same_sharding


class MoE(LayerRule):
    kind = "moe"
    doc = (
        "Top-k routed GELU MLP experts, gates renormalised over the chosen k. "
        "Expert parallel: w_in[ep, _, _], w_out[ep, _, _] "
        "(tokens travel to their experts by all-to-all and back)."
    )
    args = (
        ArgSpec("dim", "int", doc="model width"),
        ArgSpec("hidden", "int", doc="hidden width of each expert"),
        ArgSpec("experts", "int", doc="number of experts"),
        ArgSpec("top_k", "int", 2, "experts per token"),
        ArgSpec("capacity", "float", 1.25, "slots per expert, as a multiple of the even share"),
    )

    def weights(self, a: Attrs) -> tuple[WeightSpec, ...]:
        d, f, e = a["dim"], a["hidden"], a["experts"]
        return (
            WeightSpec("router", (d, e), "fan_in"),  # type: ignore[arg-type]
            WeightSpec("w_in", (e, d, f), "fan_in", fan_in=d),  # type: ignore[arg-type]
            WeightSpec("w_out", (e, f, d), "fan_in", fan_in=f),  # type: ignore[arg-type]
        )

    def validate(self, a: Attrs, ctx: Context) -> bool:
        k, e, c = a["top_k"], a["experts"], a["capacity"]
        assert isinstance(k, int) and isinstance(e, int) and isinstance(c, float)
        if k > e:
            ctx.error("E024", f"top_k ({k}) is more than the {e} experts there are", help=f"use top_k <= {e}")
            return False
        if c <= 0:
            ctx.error("E024", f"capacity must be positive, got {c}")
            return False
        return True

    def infer(self, a: Attrs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if not expect_features(ctx, x, a["dim"], "features"):  # type: ignore[arg-type]
            return None
        if x.sharding[-1]:
            ctx.error(
                "E017",
                f"`{ctx.path}` routes whole tokens, but its input's features are split over {fmt_axes(x.sharding[-1])}",
                labels=[Label(ctx.input_span, "split here")],
            )
            return None
        ep = w["w_in"].sharding[0]
        ok = same_sharding(ctx, "w_out", w["w_out"], 0, ep, "each expert's two matrices live together")
        ok &= same_sharding(ctx, "router", w["router"], 0, (), "every device routes its own tokens")
        if not ok:
            return None
        ctx.collective("all-to-all", ep, x, f"`{ctx.path}`: dispatch tokens to experts")
        ctx.collective("all-to-all", ep, x, f"`{ctx.path}`: return expert outputs")
        return TensorType(ctx.compute_dtype, x.shape, x.sharding)

    def flops(self, a: Attrs, x: TensorType, y: TensorType) -> int:
        tokens = x.numel // x.shape[-1]
        d, f, e, k = a["dim"], a["hidden"], a["experts"], a["top_k"]
        assert isinstance(d, int) and isinstance(f, int) and isinstance(e, int) and isinstance(k, int)
        return 2 * tokens * d * e + k * tokens * 4 * d * f

    def kernel_args(self, a: Attrs, dtype: str, operand: Sharding) -> dict[str, object]:
        return {"top_k": a["top_k"], "dtype": dtype}
