"""Multi-head and grouped-query self-attention, split over heads for tensor parallelism."""

from __future__ import annotations

from dslc.diagnostics import Label
from dslc.ir.nodes import Sharding, TensorType
from dslc.layers.base import (
    ArgSpec,
    Attrs,
    Context,
    LayerRule,
    WeightSpec,
    contract,
    expect_features,
    fmt_axes,
    gather_dims,
    same_sharding,
)


def _divisors(n: int) -> str:
    ok = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ok[0] if len(ok) == 1 else ", ".join(ok[:-1]) + " or " + ok[-1]


def _divisors_note(n: int, what: str) -> str:
    return f"{what} = {n} splits evenly over an axis of size {_divisors(n)}"


class Attention(LayerRule):
    kind = "attention"
    doc = (
        "Self-attention on [batch, seq, dim]. q, k, v: [dim, heads*head_dim] column parallel "
        "(split whole heads), o: [heads*head_dim, dim] row parallel."
    )
    args = (
        ArgSpec("dim", "int", doc="model width"),
        ArgSpec("heads", "int", doc="query heads"),
        ArgSpec("kv_heads", "int", lambda a: a["heads"], "key/value heads (grouped-query when fewer)"),
        ArgSpec("head_dim", "int", lambda a: a["dim"] // a["heads"], "width of one head"),  # type: ignore[operator]
        ArgSpec("causal", "bool", True, "mask future tokens"),
        ArgSpec("rope", "bool", False, "rotary position embedding on q and k"),
        ArgSpec("rope_base", "float", 10000.0, "rotary base frequency"),
    )

    def weights(self, a: Attrs) -> tuple[WeightSpec, ...]:
        d, h, kv, hd = (a["dim"], a["heads"], a["kv_heads"], a["head_dim"])
        return (
            WeightSpec("q", (d, h * hd), "fan_in"),  # type: ignore[operator]
            WeightSpec("k", (d, kv * hd), "fan_in"),  # type: ignore[operator]
            WeightSpec("v", (d, kv * hd), "fan_in"),  # type: ignore[operator]
            WeightSpec("o", (h * hd, d), "fan_in"),  # type: ignore[operator]
        )

    def validate(self, a: Attrs, ctx: Context) -> bool:
        h, kv = a["heads"], a["kv_heads"]
        assert isinstance(h, int) and isinstance(kv, int)
        if h % kv:
            ctx.error(
                "E024",
                f"heads ({h}) must be a multiple of kv_heads ({kv}) for grouped-query attention",
                notes=[f"kv_heads must divide heads = {h}: {_divisors(h)}"],
            )
            return False
        if a["rope"] and a["head_dim"] % 2:  # type: ignore[operator]
            ctx.error(
                "E024", f"rotary embeddings rotate pairs of features, so head_dim must be even, got {a['head_dim']}"
            )
            return False
        return True

    def infer(self, a: Attrs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 3:
            ctx.error(
                "E016",
                f"`{ctx.path}` expects [batch, seq, dim], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a["dim"], "features"):  # type: ignore[arg-type]
            return None
        tp = w["q"].sharding[1]
        if not self._heads_split(ctx, a, w, tp):
            return None
        if not same_sharding(ctx, "o", w["o"], 0, tp, "it reads the heads that `q` produced"):
            return None
        seq_axes = tuple(ax for ax in x.sharding[1] if ax not in tp)
        if seq_axes:
            ctx.error(
                "E029",
                f"`{ctx.path}` needs every token of the sequence, but the sequence is split over {fmt_axes(seq_axes)}",
                labels=[Label(ctx.input_span, f"split here: {x.describe()}")],
                help="context-parallel (ring) attention is not available yet; gather the sequence with `layout` first",
            )
            return None
        # One gather of the tokens serves q, k and v alike (Megatron sequence parallelism).
        x = gather_dims(ctx, x, tp, 2, f"`{ctx.path}`: gather tokens (sequence parallel)")
        ctx.operand = x.sharding
        heads_out = contract(ctx, x, w["q"], "q", ctx.compute_dtype)
        if heads_out is None or None in (contract(ctx, x, w[n], n, ctx.compute_dtype) for n in "kv"):
            return None
        return contract(ctx, heads_out, w["o"], "o", ctx.compute_dtype, is_input=False)

    def _heads_split(self, ctx: Context, a: Attrs, w: dict[str, TensorType], tp: tuple[str, ...]) -> bool:
        size = ctx.mesh.size(tp)
        h, kv = a["heads"], a["kv_heads"]
        assert isinstance(h, int) and isinstance(kv, int)
        if h % size:
            ctx.error(
                "E015",
                f"{h} attention heads cannot be split over {fmt_axes(tp)} of size {size}",
                at=ctx.weight_span("q"),
                notes=[_divisors_note(h, "heads")],
                help="change heads, or the size of the tensor-parallel axis in --mesh",
            )
            return False
        kv_split = w["k"].sharding[1]
        if kv_split:
            if kv_split != tp or w["v"].sharding[1] != tp:
                name = "k" if kv_split != tp else "v"
                same_sharding(ctx, name, w[name], 1, tp, "keys and values are split like the query heads they serve")
                return False
            if kv % size:
                ctx.error(
                    "E015",
                    f"{kv} key/value heads cannot be split over {fmt_axes(tp)} of size {size}",
                    at=ctx.weight_span("k"),
                    notes=[_divisors_note(kv, "kv_heads")],
                    help="replicate k and v (k[_, _], v[_, _]) or use a kv_heads divisible by the axis size",
                )
                return False
        elif w["v"].sharding[1]:
            same_sharding(ctx, "v", w["v"], 1, (), "keys and values are split alike")
            return False
        return True

    def flops(self, a: Attrs, x: TensorType, y: TensorType) -> int:
        b, s, d = x.shape
        h, kv, hd = (a["heads"], a["kv_heads"], a["head_dim"])
        assert isinstance(h, int) and isinstance(kv, int) and isinstance(hd, int)
        projections = 2 * b * s * d * (2 * h + 2 * kv) * hd
        scores_and_mix = 2 * 2 * b * h * s * s * hd
        return projections + scores_and_mix

    def kernel_args(self, a: Attrs, dtype: str, operand: Sharding) -> dict[str, object]:
        return {name: a[name] for name in ("heads", "kv_heads", "causal", "rope", "rope_base")} | {"dtype": dtype}
