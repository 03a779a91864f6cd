"""Multi-head and grouped-query self-attention, split over heads for tensor parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from dslc.diagnostics import Label
from dslc.ir.nodes import DTYPE_BYTES, Axes, Collective, Layer, Mesh, Sharding, TensorType
from dslc.layers.base import (
    F32,
    Attrs,
    BoundKernel,
    Context,
    LayerRule,
    WeightSpec,
    arg,
    bias_add_flops,
    contract,
    expect_features,
    fmt_axes,
    gather_dims,
    operand_numel,
    same_sharding,
)


def _divisors(n: int) -> str:
    ok = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ok[0] if len(ok) == 1 else ", ".join(ok[:-1]) + " or " + ok[-1]


def _divisors_note(n: int, what: str) -> str:
    return f"{what} = {n} splits evenly over an axis of size {_divisors(n)}"


def _head_width(a: Attrs) -> object:
    # Integers when elaborating; docs/gen_layers.py passes symbols, which divide alike.
    return cast(int, a["dim"]) // cast(int, a["heads"])


# Under `kernel=auto`, sequences of at least this many tokens take the flash algorithm,
# shorter ones the dense one: at 256 tokens dense is as fast or faster and its scores are
# small (bench/bench_attention.py measures both).
FLASH_FROM = 1024


@dataclass(frozen=True, slots=True)
class AttentionArgs:
    """The arguments of one use of `Attention`."""

    dim: int = arg("int", doc="model width")
    heads: int = arg("int", doc="query heads")
    kv_heads: int = arg("int", lambda a: a["heads"], "key/value heads (grouped-query when fewer)")
    head_dim: int = arg("int", _head_width, "width of one head")
    causal: bool = arg("bool", True, "mask future tokens")
    rope: bool = arg("bool", False, "rotary position embedding on q and k")
    rope_base: float = arg("float", 10000.0, "rotary base frequency")
    rope_dims: int | None = arg(
        "int",
        None,
        "rotate only the first `rope_dims` features of each head, the rest as they are (GPT-NeoX's rotary_pct, "
        "GPT-J's rotary_dim); all of them when left out",
    )
    bias: bool = arg("bool", False, "add a bias to q, k, v and o (GPT-2)")
    qkv_bias: bool = arg("bool", False, "add a bias to q, k and v only (Qwen2)")
    window: int | None = arg("int", None, "sliding window: a query sees only the `window` latest keys, itself included")
    kernel: str = arg(
        "choice",
        "auto",
        "the core's algorithm: `dense` (every score at once), `flash` (block by block, keeping none; a fused "
        f"kernel where the backend has one), `auto` (flash from {FLASH_FROM} tokens, or with `segments`)",
        choices=("auto", "dense", "flash"),
    )
    segments: str | None = arg(
        "input",
        None,
        "a declared input [batch, seq] of document ids: a query sees only its own document's keys, and rotary "
        "positions restart at each document",
    )
    qk_norm: bool = arg("bool", False, "RMSNorm each head's query and key before the rotary (Qwen3, OLMo 2)")
    norm_eps: float = arg("float", 1e-6, "added to the variance in the query and key norms")
    softcap: float | None = arg(
        "float",
        None,
        "cap the scaled scores at softcap * tanh(s / softcap) before the mask and softmax (Gemma 2: 50.0)",
    )
    memory: str | None = arg(
        "stream",
        None,
        "cross-attention: keys and values from this stream or declared input [batch, keys, dim] (an encoder's "
        "output) rather than from the layer's input; with causal=false",
    )
    position_bias: str | None = arg(
        "stream",
        None,
        "a stream [1, heads, seq, keys] added to the scaled scores (T5's `relative_position_bias`)",
    )
    scale: float | None = arg("float", None, "what q·k is multiplied by; 1/sqrt(head_dim) when left out (T5: 1.0)")

    @property
    def score_scale(self) -> float:
        """What q·k is multiplied by: `scale`, or 1/sqrt(head_dim)."""
        return self.scale if self.scale is not None else self.head_dim**-0.5


def algorithm(a: AttentionArgs, seq: int) -> str:
    """The core's algorithm for a sequence of `seq` tokens: "dense" or "flash". Attention
    over a memory, or with a position bias added to its scores, is dense: the flash core's
    blocks are of one sequence against itself, and take no bias."""
    if a.kernel != "auto":
        return a.kernel
    if a.memory is not None or a.position_bias is not None:
        return "dense"
    return "flash" if seq >= FLASH_FROM or a.segments is not None else "dense"


class Attention(LayerRule[AttentionArgs]):
    kind = "attention"
    doc = (
        "Self-attention on [batch, seq, dim]. q, k, v: [dim, heads*head_dim] column parallel "
        "(split whole heads), o: [heads*head_dim, dim] row parallel. Biases split like their "
        "projection's output: q_bias[tp], k_bias[tp], v_bias[tp], o_bias[_]."
    )
    Args = AttentionArgs

    def weights(self, a: AttentionArgs) -> tuple[WeightSpec, ...]:
        d, h, kv, hd = a.dim, a.heads, a.kv_heads, a.head_dim
        # Under a scale of its own the queries start smaller or larger by what the scale adds
        # over 1/sqrt(head_dim), so that the scores start out alike (T5's initialisation).
        gain = 1.0 if a.scale is None else hd**-0.5 / a.scale
        projections = (
            WeightSpec("q", (d, h * hd), "fan_in", gain=gain),
            WeightSpec("k", (d, kv * hd), "fan_in"),
            WeightSpec("v", (d, kv * hd), "fan_in"),
            WeightSpec("o", (h * hd, d), "fan_in"),
        )
        biased = "qkvo" if a.bias else "qkv" if a.qkv_bias else ""
        norms = (WeightSpec("q_norm", (hd,), "ones"), WeightSpec("k_norm", (hd,), "ones")) if a.qk_norm else ()
        return (
            projections
            + tuple(WeightSpec(f"{w.name}_bias", w.shape[1:], "zeros") for w in projections if w.name in biased)
            + norms
        )

    def validate(self, a: AttentionArgs, ctx: Context) -> bool:
        h, kv = a.heads, a.kv_heads
        if h % kv:
            ctx.error(
                "E024",
                f"heads ({h}) must be a multiple of kv_heads ({kv}) for grouped-query attention",
                at=ctx.arg_span("kv_heads"),
                notes=[f"kv_heads must divide heads = {h}: {_divisors(h)}"],
            )
            return False
        if a.window is not None and not a.causal:
            ctx.error(
                "E024",
                "a sliding window keeps the latest keys before each query, so it needs causal=true",
                at=ctx.arg_span("window"),
                help="write causal=true, or leave out `window`",
            )
            return False
        if a.memory is not None:
            taken = {"causal": a.causal, "rope": a.rope, "segments": a.segments is not None}
            wrong = next((name for name, given in taken.items() if given), None)
            if wrong is not None:
                ctx.error(
                    "E024",
                    f"cross-attention sees every token of its memory, which is another sequence than its queries', "
                    f"so it takes no `{wrong}`" + (" (true unless written false)" if wrong == "causal" else ""),
                    at=ctx.arg_span(wrong) if wrong in ctx.arg_spans else ctx.arg_span("memory"),
                    help=f"write {wrong}=false" if wrong != "segments" else "leave out `segments`",
                )
                return False
        if a.kernel == "flash" and (a.memory is not None or a.position_bias is not None):
            given = "memory" if a.memory is not None else "position_bias"
            ctx.error(
                "E024",
                f"the flash kernel computes one sequence against itself with no bias, so it takes no `{given}`",
                at=ctx.arg_span("kernel"),
                help="write kernel=dense, or leave `kernel` out",
            )
            return False
        if a.rope and a.head_dim % 2:
            ctx.error(
                "E024",
                f"rotary embeddings rotate pairs of features, so head_dim must be even, got {a.head_dim}",
                at=ctx.arg_span("head_dim") if "head_dim" in ctx.arg_spans else ctx.arg_span("rope"),
            )
            return False
        if a.rope_dims is not None and not (a.rope and a.rope_dims % 2 == 0 and a.rope_dims <= a.head_dim):
            ctx.error(
                "E024",
                f"rope_dims rotates pairs among a head's first features: an even number up to head_dim = "
                f"{a.head_dim}, with rope=true; got {a.rope_dims}" + ("" if a.rope else " without rope"),
                at=ctx.arg_span("rope_dims"),
                help="write rope=true, and an even rope_dims no larger than head_dim",
            )
            return False
        return True

    def infer(self, a: AttentionArgs, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        if x.rank != 3:
            ctx.error(
                "E016",
                f"`{ctx.path}` expects [batch, seq, dim], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        if not expect_features(ctx, x, a.dim, "features"):
            return None
        tp = w["q"].sharding[1]
        if not self._heads_split(ctx, a, w, tp):
            return None
        if not same_sharding(ctx, "o", w["o"], 0, tp, "it reads the heads that `q` produced"):
            return None
        for name in ("q_norm", "k_norm"):
            if name in w and not same_sharding(ctx, name, w[name], 0, (), "every head is normalised whole"):
                return None
        for name in ("q", "k", "v", "o"):
            bias = f"{name}_bias"
            if bias in w and not same_sharding(
                ctx, bias, w[bias], 0, w[name].sharding[1], f"it is added to the output of `{name}`"
            ):
                return None
        # Tokens split over the tensor-parallel axis are gathered, one gather serving q, k and
        # v alike (Megatron sequence parallelism); tokens split over another axis stay split
        # and the layer becomes ring attention over it (context parallelism).
        x = gather_dims(ctx, x, tp, 2, f"`{ctx.path}`: gather tokens (sequence parallel)")
        context = x.sharding[1]
        if context and not self._context_parallel(a, x, context, ctx):
            return None
        if a.segments is not None and not self._segments_fit(a.segments, x, ctx):
            return None
        keys = x
        if a.memory is not None:
            if context:
                ctx.error(
                    "E029",
                    f"`{ctx.path}` is ring attention (its sequence is split over {fmt_axes(context)}), which does "
                    "not read a memory",
                    at=ctx.arg_span("memory"),
                    help="leave the sequence whole in cross-attention layers",
                )
                return None
            found = self._memory(a, a.memory, x, ctx)
            if found is None:
                return None
            keys = found
        if a.position_bias is not None and not self._bias_fits(a, a.position_bias, x, keys, tp, ctx):
            return None
        if context and a.causal:
            half = TensorType(ctx.compute_dtype, (x.shape[0], x.shape[1] // 2, x.shape[2]), x.sharding)
            for part in ("first", "second"):
                ctx.collective(
                    "collective-permute", context, half, f"`{ctx.path}`: zig-zag the {part} half of the tokens"
                )
        heads_out = contract(ctx, x, w["q"], "q", ctx.compute_dtype)
        if heads_out is None or None in (
            contract(ctx, keys, w[n], n, ctx.compute_dtype, is_input=keys is x) for n in "kv"
        ):
            return None
        if context:
            self._ring_passes(a, x, w, context, ctx)
        return contract(ctx, heads_out, w["o"], "o", ctx.compute_dtype, is_input=False)

    def _context_parallel(self, a: AttentionArgs, x: TensorType, context: tuple[str, ...], ctx: Context) -> bool:
        """Whether ring attention can run over `context`; reports why not."""
        split = f"split here: {x.describe()}"
        if len(context) > 1:
            ctx.error(
                "E029",
                f"`{ctx.path}` can pass key/value blocks around one mesh axis, but its sequence is split over "
                f"{fmt_axes(context)}",
                labels=[Label(ctx.input_span, split)],
                help="split the sequence over one axis (a mesh axis of their combined size) for context parallelism",
            )
            return False
        # What the ring's blocks do not compute: a sliding window, a cap on the scores.
        untaken = {"window": (a.window, "sliding window"), "softcap": (a.softcap, "cap on its scores")}
        for name, (given, what) in untaken.items():
            if given is not None and ctx.mesh.size(context) > 1:
                ctx.error(
                    "E029",
                    f"`{ctx.path}` is ring attention (its sequence is split over {fmt_axes(context)}), which takes no "
                    + what,
                    at=ctx.arg_span(name),
                    labels=[Label(ctx.input_span, split)],
                    help=f"leave the sequence whole, or leave out `{name}`",
                )
                return False
        ring, seq = ctx.mesh.size(context), x.shape[1]
        # A ring of one device is plain attention: nothing to balance.
        if a.causal and ring > 1 and seq % (2 * ring):
            ctx.error(
                "E014",
                f"`{ctx.path}` splits its {seq} tokens into 2 x {context[0]}={ring} = {2 * ring} equal chunks "
                f"for causal context parallelism, but {seq} does not split evenly into {2 * ring}",
                labels=[Label(ctx.input_span, split)],
                notes=[
                    f"device i of `{context[0]}` works on chunks i and {2 * ring - 1}-i, so that every device "
                    "does the same work under the causal mask",
                    f"{seq} splits evenly into {_divisors(seq)} chunks",
                ],
                help=f"make the sequence a multiple of {2 * ring}, or choose a `{context[0]}` size whose double "
                "divides it",
            )
            return False
        return True

    def _segments_fit(self, name: str, x: TensorType, ctx: Context) -> bool:
        """Whether the declared input `name` holds one integer document id per token of `x`,
        split like its tokens; reports why not."""
        given = ctx.inputs[name].type
        want = f"integer ids shaped like the tokens, [{x.shape[0]}, {x.shape[1]}]"
        if given.dtype not in ("i32", "i64", "i8") or given.shape != x.shape[:2]:
            ctx.error(
                "E016",
                f"`segments` of `{ctx.path}` reads input `{name}`, which is {given.describe()}: it needs {want}",
                at=ctx.arg_span("segments"),
            )
            return False
        if given.sharding != x.sharding[:2]:
            ctx.error(
                "E017",
                f"`segments` of `{ctx.path}` reads input `{name}` split as {given.describe()}, but the tokens are "
                f"split as {x.describe()}",
                at=ctx.arg_span("segments"),
                help="split the document ids' batch and sequence dimensions like the tokens'",
            )
            return False
        if x.sharding[1]:
            ctx.error(
                "E029",
                f"`{ctx.path}` is ring attention (its sequence is split over {fmt_axes(x.sharding[1])}), which does "
                "not take packed documents",
                at=ctx.arg_span("segments"),
                help="leave the sequence whole, or leave out `segments`",
            )
            return False
        return True

    def _memory(self, a: AttentionArgs, name: str, x: TensorType, ctx: Context) -> TensorType | None:
        """The type of the memory `name` the keys and values are computed from; None after
        reporting why it cannot be read: [batch, keys, dim] like the input's batch, its tokens
        and features whole on every device that reads it."""
        m = ctx.inputs[name].type
        if m.rank != 3 or m.shape[0] != x.shape[0] or m.shape[2] != a.dim or m.dtype not in ("f32", "bf16", "f16"):
            ctx.error(
                "E016",
                f"`memory` of `{ctx.path}` reads `{name}`, which is {m.describe()}: it needs the keys' tokens "
                f"[{x.shape[0]}, keys, {a.dim}] in floating point, as many sequences as the queries' batch",
                at=ctx.arg_span("memory"),
                labels=[Label(ctx.inputs[name].span, f"`{name}` is made here")],
            )
            return None
        if m.sharding[0] != x.sharding[0] or m.sharding[1] or m.sharding[2]:
            axes = x.sharding[0]
            batch = "_" if not axes else axes[0] if len(axes) == 1 else f"({', '.join(axes)})"
            ctx.error(
                "E017",
                f"`memory` of `{ctx.path}` reads `{name}` split as {m.describe()}, but each device needs its "
                f"sequences' whole memory, split like the queries' batch ({x.describe()})",
                at=ctx.arg_span("memory"),
                labels=[Label(ctx.inputs[name].span, f"`{name}` is made here")],
                help=f"end the stream with `layout [{batch}, _, _]`",
            )
            return None
        return m

    def _bias_fits(self, a: AttentionArgs, name: str, x: TensorType, keys: TensorType, tp: Axes, ctx: Context) -> bool:
        """Whether the stream `name` is a bias [1, heads, seq, keys] for these scores, its
        heads split like the query heads; reports why not."""
        bias = ctx.inputs[name].type
        want = (1, a.heads, x.shape[1], keys.shape[1])
        if bias.shape != want or bias.dtype not in ("f32", "bf16", "f16"):
            ctx.error(
                "E016",
                f"`position_bias` of `{ctx.path}` reads `{name}`, which is {bias.describe()}: it needs "
                f"[{', '.join(map(str, want))}] in floating point, a score for each head, query and key",
                at=ctx.arg_span("position_bias"),
                labels=[Label(ctx.inputs[name].span, f"`{name}` is made here")],
            )
            return False
        if bias.sharding != ((), tp, (), ()):
            heads = "_" if not tp else tp[0] if len(tp) == 1 else f"({', '.join(tp)})"
            ctx.error(
                "E017",
                f"`position_bias` of `{ctx.path}` reads `{name}` split as {bias.describe()}, but its heads must be "
                f"split as the query heads are ({fmt_axes(tp) if tp else 'whole'}) and nothing else",
                at=ctx.arg_span("position_bias"),
                labels=[Label(ctx.inputs[name].span, f"`{name}` is made here")],
                help=f"shard the bias table's heads like `q`'s: table[_, {heads}]",
            )
            return False
        return True

    def _ring_passes(
        self, a: AttentionArgs, x: TensorType, w: dict[str, TensorType], context: Axes, ctx: Context
    ) -> None:
        """The collectives of the ring: ring - 1 passes of the key and of the value blocks,
        then (causal) the outputs back to token order.

        The keys' and outputs' heads may be split over a tensor-parallel axis, and a ring
        moves only one tensor-parallel rank's heads: that share is what the collectives
        count as their tensor (`Collective.elements` is per group of the collective).
        """
        b, seq, _ = x.shape
        h, kv, hd = a.heads, a.kv_heads, a.head_dim
        ring = ctx.mesh.size(context)
        kv_local = kv * hd // ctx.mesh.size(w["k"].sharding[1])
        blocks = TensorType(ctx.compute_dtype, (b, seq, kv_local), (x.sharding[0], context, ()))
        for name in ("key", "value"):
            for step in range(1, ring):
                ctx.collective(
                    "collective-permute", context, blocks, f"`{ctx.path}`: ring pass {step}/{ring - 1} of {name} blocks"
                )
        if a.causal:
            heads_local = h * hd // ctx.mesh.size(w["q"].sharding[1])
            half = TensorType(ctx.compute_dtype, (b, seq // 2, heads_local), (x.sharding[0], context, ()))
            for part in ("first", "second"):
                ctx.collective(
                    "collective-permute",
                    context,
                    half,
                    f"`{ctx.path}`: the {part} half of the outputs back to token order",
                )

    def _heads_split(self, ctx: Context, a: AttentionArgs, w: dict[str, TensorType], tp: tuple[str, ...]) -> bool:
        size = ctx.mesh.size(tp)
        h, kv = a.heads, a.kv_heads
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

    def flops(self, a: AttentionArgs, x: TensorType, y: TensorType) -> int:
        return self.layer_flops(a, x, x.shape[1])

    def flops_reading(self, a: AttentionArgs, x: TensorType, y: TensorType, reads: Mapping[str, TensorType]) -> int:
        return self.layer_flops(a, x, reads["memory"].shape[1] if "memory" in reads else x.shape[1])

    def layer_flops(self, a: AttentionArgs, x: TensorType, keys: int) -> int:
        """FLOPs of the layer on `x` whose keys and values come from `keys` tokens (its own, or
        its memory's)."""
        b, s, d = x.shape
        h, kv, hd = a.heads, a.kv_heads, a.head_dim
        projections = 2 * b * s * d * 2 * h * hd + 2 * b * keys * d * 2 * kv * hd
        qkv_biased, o_biased = a.bias or a.qkv_bias, a.bias
        biases = bias_add_flops(b * s, h * hd * qkv_biased + d * o_biased) + bias_add_flops(
            b * keys, 2 * kv * hd * qkv_biased
        )
        return projections + _scores_and_mix(a, x, keys) + biases

    def core_flops(self, layer: Layer) -> int:
        # The scores q·kᵀ, half of the core's: the weighted sum's gradient needs only the
        # probabilities and the values, so autodiff never reruns the sum itself. Ring and
        # flash attention have no core to spare: their backward recomputes the scores block by
        # block anyway.
        return (
            0 if _keeps_no_scores(layer) else _scores_and_mix(self.args_of(layer), layer.input, keys_length(layer)) // 2
        )

    def no_core_note(self, layer: Layer) -> str | None:
        if self.core_flops(layer):
            return None
        kind = "ring" if layer.operand and layer.operand[1] else "flash"
        return f"`{layer.path}` is {kind} attention, which keeps no scores"

    def backward_collectives(self, layer: Layer, mesh: Mesh) -> tuple[Collective, ...]:
        return ring_backward_collectives(layer, mesh)

    def context_axes(self, layer: Layer, mesh: Mesh) -> Axes:
        return context_axes(layer, mesh)

    def pipeline_refusal(self, layer: Layer) -> str | None:
        if self.kernel(self.args_of(layer), layer.operand) != "ring_attention":
            return None
        return "is context-parallel (ring) attention, which does not run inside a pipeline stage yet"

    def core_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        if not self.core_flops(layer):
            return 0
        _, _, _, scores, _ = _attention_sizes(layer, mesh, slices)
        return scores * _score_copies(compute, self.args_of(layer))

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        c = DTYPE_BYTES[compute]
        x, q, k_v, scores, rows = _attention_sizes(layer, mesh, slices)
        if _flash(layer):
            # Flash: the output and each query row's log-sum-exp (f32), besides its inputs.
            return x * c + (2 * q + k_v) * c + rows * F32  # operand, q, k, v, output, lse
        if context_axes(layer, mesh):
            # Ring attention keeps no scores: its backward recomputes them block by block from
            # the log-sum-exp of each query row (f32). Zig-zagged (causal), the outputs are kept
            # twice: in that layout for the ring's backward, in token order for the output
            # projection's.
            outputs = 2 if self.args_of(layer).causal else 1
            return x * c + (q + k_v + outputs * q) * c + rows * F32  # operand, q, k, v, outputs, lse
        # The operand, q, k, v, the mixed heads, the probabilities (and a cap's f32 input).
        return x * c + (2 * q + k_v) * c + scores * _score_copies(compute, self.args_of(layer))

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        # Besides the core's, the operand's gradient: one partial product of the operand's
        # size from each of the q, k, v projections (in f32, as a matrix product writes it
        # before the sum; whole on every device under tensor parallelism, then all-reduced).
        # Ring attention adds its gradients up as it goes (below).
        x = _attention_sizes(layer, mesh, slices)[0]
        projections = 0 if context_axes(layer, mesh) else 3 * x * F32
        return projections + self._core_workspace(layer, mesh, compute, slices)

    def _core_workspace(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        if _flash(layer):
            # Flash's backward: one block's scores recomputed, their probabilities, the
            # probabilities' gradient and the scores' (f32), and f32 accumulators of dq (whole)
            # and of one block's dk, dv.
            _, q, k_v, _, rows = _attention_sizes(layer, mesh, slices)
            seq = layer.input.shape[1]
            block = flash_block(seq)
            scores = rows // seq * block * block  # one query block against one key block
            # With a cap, the scores before and after it exist side by side (its gradient).
            copies = 5 if self.args_of(layer).softcap is not None else 4
            return copies * scores * F32 + q * F32 + k_v * F32 * block // seq
        if not context_axes(layer, mesh):
            # The dense core's: the residuals' gradients, the probabilities' in the compute
            # dtype, and the softmax's backward in f32 (the probabilities, the scores' gradient).
            scores = _attention_sizes(layer, mesh, slices)[3]
            return self.residual_bytes(layer, mesh, compute, slices) + 2 * scores * F32
        # Ring attention's backward adds its gradients up in f32 accumulators as it goes (dq,
        # and dk, dv travelling with the blocks: sent and received) rather than holding
        # gradients of all its residuals at once; its largest transients are one block's
        # scores recomputed, their probabilities and the gradients of both (f32).
        _, q, k_v, scores, _ = _attention_sizes(layer, mesh, slices)
        return 4 * scores * F32 + (q + 2 * k_v) * F32

    def kernel(self, a: AttentionArgs, operand: Sharding) -> str:
        # `infer` accepts a sequence split over one axis at most (besides the heads' axis,
        # which it gathers): context parallelism.
        return "ring_attention" if operand[1] else "attention"

    def kernel_args(
        self, a: AttentionArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        static: dict[str, object] = {"heads": a.heads, "kv_heads": a.kv_heads, "causal": a.causal}
        static |= {"axis": operand[1][0]} if operand[1] else {"window": a.window} if a.window is not None else {}
        if a.rope:
            partial = (("dims", a.rope_dims),) if a.rope_dims not in (None, a.head_dim) else ()
            passes = (("base", "rope_base"), ("dims", "rope_dims"))
            static["rope"] = BoundKernel("rotary", (("base", a.rope_base), *partial), passes)
        if a.qk_norm:
            static["norm_eps"] = a.norm_eps
        if a.softcap is not None and not operand[1]:
            static["softcap"] = a.softcap
        if a.scale is not None:
            static["scale"] = a.scale
        return static | {"dtype": dtype}

    def sized_args(self, a: AttentionArgs, x: TensorType, operand: Sharding) -> dict[str, object]:
        if operand and operand[1]:
            return {}
        seq = x.shape[1]
        chosen = algorithm(a, seq)
        return {"kernel": chosen} | ({"block": flash_block(seq)} if chosen == "flash" else {})


def _keeps_no_scores(layer: Layer) -> bool:
    """Whether the layer's core keeps no scores for its backward pass: ring attention, and
    the flash algorithm."""
    return bool(layer.operand and layer.operand[1]) or _flash(layer)


def _flash(layer: Layer) -> bool:
    """Whether the layer runs the flash algorithm on one device's whole sequence (a sequence
    split over a context axis is ring attention, plain attention on a ring of one)."""
    ring = bool(layer.operand and layer.operand[1])
    return not ring and algorithm(Attention().args_of(layer), layer.input.shape[1]) == "flash"


# The flash algorithm's blocks, in tokens (queries and keys alike).
FLASH_BLOCK = 512


def flash_block(seq: int) -> int:
    """The flash algorithm's block for `seq` tokens: FLASH_BLOCK, the whole of a shorter
    sequence, or the largest power of two that divides a sequence FLASH_BLOCK does not."""
    if seq <= FLASH_BLOCK:
        return seq
    block = FLASH_BLOCK
    while seq % block:
        block //= 2
    return block


def _scores_and_mix(a: AttentionArgs, x: TensorType, keys: int | None = None) -> int:
    """FLOPs of the scores q·kᵀ [b, heads, s, keys] and of their weighted sum of the values
    (`keys`: the memory's tokens; the input's own when None)."""
    b, s, _ = x.shape
    h, hd = a.heads, a.head_dim
    return 2 * 2 * b * h * s * (s if keys is None else keys) * hd


def keys_length(layer: Layer) -> int:
    """The tokens a checked attention layer's keys come from: its memory's, or its own."""
    reads = dict(layer.reads)
    return reads["memory"].shape[1] if "memory" in reads else layer.input.shape[1]


def _score_copies(compute: str, a: AttentionArgs) -> int:
    """Bytes kept per score [b, heads, s, s]: the probabilities, in the compute dtype (the
    dense core's softmax, dslc.runtime.attention._softmax, keeps nothing else), and with
    `softcap` the scores before the cap, in f32, for its gradient."""
    return DTYPE_BYTES[compute] + (F32 if a.softcap is not None else 0)


def _attention_sizes(layer: Layer, mesh: Mesh, slices: int) -> tuple[int, int, int, int, int]:
    """Elements on one device of the operand, the queries, the keys and values together, the
    scores of one query block against one key block, and the rows of those scores."""
    # The operand, not the input: sequence parallelism gathers the tokens first, and under
    # context parallelism the layer works on its own share of them.
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    b, s, _ = operand.local_shape(mesh)
    b = -(-b // slices)
    a = Attention().args_of(layer)
    h, kv, hd = a.heads, a.kv_heads, a.head_dim
    h_local = h // mesh.size(layer.weight("q").type.sharding[1])
    kv_local = kv // mesh.size(layer.weight("k").type.sharding[1])
    rows = b * h_local * s
    # Under context parallelism the keys are this device's share of the sequence, as the
    # queries are; a memory is whole on every device.
    keys = s if "memory" not in dict(layer.reads) else keys_length(layer)
    return operand_numel(layer, mesh, slices), rows * hd, 2 * b * keys * kv_local * hd, rows * keys, rows


def ring_backward_collectives(layer: Layer, mesh: Mesh) -> tuple[Collective, ...]:
    """What ring attention's backward pass sends besides the transposes of its forward
    collectives: the f32 gradient accumulators of the key and value blocks travel with the
    blocks and take one pass more to come home, `ring` passes each (see
    `dslc.runtime.attention._ring_backward`)."""
    context = context_axes(layer, mesh)
    if not context:
        return ()
    b, seq, _ = layer.input.shape
    a = Attention().args_of(layer)
    kv, hd = a.kv_heads, a.head_dim
    kv_local = kv * hd // mesh.size(layer.weight("k").type.sharding[1])
    ring = mesh.size(context)
    return tuple(
        Collective("collective-permute", context, b * seq * kv_local, "f32", f"`{layer.path}`: {name} gradient pass")
        for name in ("key", "value")
        for _ in range(ring)
    )


def context_axes(layer: Layer, mesh: Mesh) -> Axes:
    """The mesh axes a checked layer passes key/value blocks around (context parallelism);
    empty for every layer but an attention layer over a sequence split over more than one
    device (the kernel computes a ring of one as plain attention)."""
    if layer.kind != Attention.kind or not layer.operand or mesh.size(layer.operand[1]) == 1:
        return ()
    return layer.operand[1]


@dataclass(frozen=True, slots=True)
class RelativePositionBiasArgs:
    """The arguments of one use of `RelativePositionBias`."""

    heads: int = arg("int", doc="attention heads")
    buckets: int = arg("int", 32, "distance buckets (T5's relative_attention_num_buckets)")
    max_distance: int = arg("int", 128, "distances past this share the last bucket")
    bidirectional: bool = arg(
        "bool",
        True,
        "keys before and after a query take buckets of their own (an encoder's); false: a decoder's, whose "
        "queries see only earlier keys",
    )


class RelativePositionBias(LayerRule[RelativePositionBiasArgs]):
    """T5's relative position bias: a learned score per head for each bucket of key-minus-query
    distances (exact for near ones, logarithmic out to `max_distance`), as a stream that the
    attention layers of a stack add to their scores (`attention(..., position_bias=NAME)`):
    one table for all of them, as T5 computes it in its first layer and passes it on."""

    kind = "relative_position_bias"
    doc = (
        "T5's relative position bias from [batch, seq, ...] (tokens or vectors; only their number is read) to "
        "[1, heads, seq, seq]: table [buckets, heads], its heads split like the attention heads that read it."
    )
    Args = RelativePositionBiasArgs

    def weights(self, a: RelativePositionBiasArgs) -> tuple[WeightSpec, ...]:
        return (WeightSpec("table", (a.buckets, a.heads), "normal"),)

    def validate(self, a: RelativePositionBiasArgs, ctx: Context) -> bool:
        exact = a.buckets // 2 if a.bidirectional else a.buckets
        if exact < 2 or a.max_distance <= exact // 2:
            ctx.error(
                "E024",
                f"`{ctx.path}` keeps half of its {exact} buckets{' each way' if a.bidirectional else ''} for exact "
                f"distances and spreads the rest out to max_distance = {a.max_distance}, which must exceed "
                f"{exact // 2}",
                at=ctx.arg_span("max_distance") if "max_distance" in ctx.arg_spans else ctx.arg_span("buckets"),
                help="T5 uses buckets=32, max_distance=128",
            )
            return False
        return True

    def infer(
        self, a: RelativePositionBiasArgs, x: TensorType, w: dict[str, TensorType], ctx: Context
    ) -> TensorType | None:
        if x.rank < 2:
            ctx.error(
                "E016",
                f"`{ctx.path}` reads the length of a sequence [batch, seq, ...], but its input is {x.describe()}",
                labels=[Label(ctx.input_span, "input produced here")],
            )
            return None
        table = w["table"]
        if not same_sharding(ctx, "table", table, 0, (), "a score is looked up by its bucket, anywhere in the table"):
            return None
        seq = x.shape[1]
        return TensorType(ctx.compute_dtype, (1, a.heads, seq, seq), ((), table.sharding[1], (), ()))

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return 0  # a lookup keeps only its (constant) buckets

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        return layer.output.local_nbytes(mesh)  # the bias's gradient, summed over its readers

    def kernel_args(
        self, a: RelativePositionBiasArgs, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]
    ) -> dict[str, object]:
        return {"bidirectional": a.bidirectional, "max_distance": a.max_distance, "dtype": dtype}
