"""What every layer kind knows: its arguments, its weights, its shape and sharding rule, its cost.

A rule is consulted by the elaborator (arguments, weights), the shape pass (`infer`), the
planner (`flops`; `residual_bytes` and `workspace_bytes`, its model of activation memory; the
collectives beyond the forward's, `backward_collectives` and `pipeline_recompute_collectives`;
`context_axes`, which every gradient is summed over too), the checker (`pipeline_refusal`)
and the backends (`kernel`, `kernel_args`: which function of `dslc.runtime.layers` computes
it, with which static arguments). The planner and the checker ask the rule rather than test
a layer kind by name; the mixture-of-experts report (`dslc.plan.experts`) is about that kind.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, Literal, TypeVar

from dslc.diagnostics import Diagnostics, Label, Span
from dslc.ir.nodes import DTYPE_BYTES, Axes, Collective, CollectiveKind, Input, Layer, Mesh, Sharding, TensorType
from dslc.runtime.storage import fan_in

Attrs = dict[str, object]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()

# "any" is for block parameters, which take whatever value they are given. "stream" names a
# declared input or a `stream` computed before the layer (cross-attention's memory).
ArgType = Literal["int", "float", "bool", "input", "stream", "choice", "any"]


@dataclass(frozen=True, slots=True)
class BoundKernel:
    """A kernel's argument that is another kernel with keyword arguments bound (`rotary` and
    its base, as attention's `rope`): the generated module passes it as `functools.partial`
    and copies that kernel too, which it copies only where some layer passes it."""

    kernel: str
    keywords: tuple[tuple[str, object], ...] = ()
    # The layer's argument each keyword passes on unchanged, where one does (`base` is
    # `rope_base`): the module writes it as the spec did, in its constants.
    passes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ArgSpec:
    """One argument a layer takes. `default` may be a function of the other arguments."""

    name: str
    type: ArgType
    # An argument of type "input" may default to None: it is optional, and absent when not given.
    default: object | Callable[[Attrs], object] = REQUIRED
    doc: str = ""
    positive: bool = True
    # An argument of type "choice" is one of these words, written bare (`kernel=flash`).
    choices: tuple[str, ...] = ()
    # A number that may also be written `none` (no limit: `capacity=none`), its value None.
    nullable: bool = False


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """A weight a layer owns. `init` is "zeros", "ones", "normal" (std 0.02) or "fan_in"
    (std 1/sqrt(fan_in), fan_in being all dimensions but the last unless given)."""

    name: str
    shape: tuple[int, ...]
    init: str
    fan_in: int = 0
    # "fan_in": the standard deviation times this (attention's queries under a `scale` of its
    # own, so that the scores start out as large as under the default one).
    gain: float = 1.0

    @property
    def inputs(self) -> int:
        """What a "fan_in" weight sums into each output: `fan_in`, or all but its last dimension."""
        return self.fan_in or math.prod(self.shape[:-1])

    def initializer(self) -> str:
        """The IR's initializer: "zeros", "ones" or "normal:STD"."""
        match self.init:
            case "fan_in":
                return fan_in(self.inputs, self.gain)
            case "normal":
                return "normal:0.02"
            case _:
                return self.init


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A vocabulary a layer's weights index: `size` entries along each `dims` (weight name,
    dimension). The compiler pads those dimensions to split evenly over their mesh axes: an
    embedding's extra rows are never looked up; a head's extra outputs (`logits`: its output's
    last dimension is the vocabulary) are masked out by the loss that reads them."""

    size: int
    dims: tuple[tuple[str, int], ...]
    logits: bool = False


@dataclass
class Context:
    """What a rule sees while typing one use of its layer."""

    mesh: Mesh
    path: str
    span: Span
    input_span: Span
    inputs: dict[str, Input]
    compute_dtype: str
    diags: Diagnostics
    weight_spans: dict[str, Span] = field(default_factory=dict)
    # Where each argument written in the call is (one left to its default has none).
    arg_spans: dict[str, Span] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    # The sharding the layer's input is gathered to before it computes (sequence-parallel
    # gathers); None when the input is used as it arrives.
    operand: Sharding | None = None
    # False when a sharding this layer compares was refused where it was written (an unknown
    # axis dropped from one of its weights, or from an input it reads): "shardings do not
    # line up" (E017) would then only restate that mistake, so it is not reported.
    shardings_as_written: bool = True

    def error(
        self,
        code: str,
        message: str,
        *,
        at: Span | None = None,
        labels: Iterable[Label] = (),
        notes: Iterable[str] = (),
        help: str | None = None,
    ) -> None:
        if code == "E017" and not self.shardings_as_written:
            return
        self.diags.error(
            code,
            message,
            at or self.span,
            labels=tuple(labels),
            notes=(*notes, f"in `{self.path}`"),
            help=help,
        )

    def weight_span(self, name: str) -> Span:
        return self.weight_spans.get(name, self.span)

    def arg_span(self, name: str) -> Span:
        """Where argument `name` is written; the whole call when it was left to its default."""
        return self.arg_spans.get(name, self.span)

    def collective(self, kind: CollectiveKind, axes: Axes, t: TensorType, why: str) -> None:
        if axes and self.mesh.size(axes) > 1:
            self.collectives.append(Collective(kind, axes, t.numel, t.dtype, why))


A = TypeVar("A")


def arg_field(name: str) -> str:
    """The field of a rule's `Args` that holds argument `name`: the name itself, or, for a
    Python keyword, the name with a trailing underscore (`in_`)."""
    return name + "_" if keyword.iskeyword(name) else name


def arg(
    type: ArgType,
    default: object = REQUIRED,
    doc: str = "",
    *,
    positive: bool = True,
    choices: tuple[str, ...] = (),
    nullable: bool = False,
) -> Any:
    """One argument of a layer kind, declared as a field of its rule's `Args` (the field's
    name is the argument's, see `arg_field`): the one place an argument is declared. The
    rule's `args`, which binding and the docs read, follow from the fields in order."""
    return field(metadata={_ARG: ArgSpec("", type, default, doc, positive, choices, nullable)})


_ARG = "dslc.arg"


def declared_args(args_type: type) -> tuple[ArgSpec, ...]:
    """The arguments an `Args` dataclass declares with `arg`, in field order."""
    out = []
    for f in fields(args_type):
        name = f.name[:-1] if f.name.endswith("_") and keyword.iskeyword(f.name[:-1]) else f.name
        out.append(replace(f.metadata[_ARG], name=name))
    return tuple(out)


class LayerRule(Generic[A]):
    """Base of the layer kinds, generic in `A`, the type of one use's arguments. Subclasses
    fill in the class variables, `Args` and `infer`."""

    kind: ClassVar[str]
    doc: ClassVar[str]
    # A frozen dataclass with one field per argument, each declared by `arg` (named by
    # `arg_field`): what every method taking `a` reads, built by `parse` once a use's
    # arguments are bound and checked.
    Args: type[A]
    # The arguments as binding reads them, in order: `Args`'s fields, derived.
    args: ClassVar[tuple[ArgSpec, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Args" in cls.__dict__:
            cls.args = declared_args(cls.Args)

    def parse(self, attrs: Mapping[str, object]) -> A:
        """One use's arguments, as elaboration bound them (`Layer.attrs`), as an `Args`."""
        return self.Args(**{arg_field(name): value for name, value in attrs.items()})

    def args_of(self, layer: Layer) -> A:
        """The arguments of an elaborated use of this kind, as an `Args`."""
        return self.parse(dict(layer.attrs))

    def weights(self, a: A) -> tuple[WeightSpec, ...]:
        return ()

    def possible_weights(self, attrs: Mapping[str, object]) -> set[str]:
        """The names of the weights the use with arguments `attrs` has, and of those a boolean
        argument set the other way would give it (a bias)."""
        names = {w.name for w in self.weights(self.parse(attrs))}
        for arg in self.args:
            if arg.type == "bool":
                names |= {w.name for w in self.weights(self.parse({**attrs, arg.name: not attrs[arg.name]}))}
        return names

    def vocabulary(self, a: A, feeds_masking_loss: bool) -> Vocabulary | None:
        """The vocabulary this use's weights index, if any; `feeds_masking_loss` says its output
        goes straight to a loss that masks padded logits out (`masks_padding`)."""
        return None

    # A loss that takes `classes` and masks the logits past them out of its softmax: the layer
    # before it may pad its outputs (a vocabulary split over a tensor axis it does not divide).
    masks_padding: ClassVar[bool] = False

    def validate(self, a: A, ctx: Context) -> bool:
        """Checks among the arguments themselves; report and return False when they clash."""
        return True

    def infer(self, a: A, x: TensorType, w: dict[str, TensorType], ctx: Context) -> TensorType | None:
        raise NotImplementedError

    def flops_reading(self, a: A, x: TensorType, y: TensorType, reads: Mapping[str, TensorType]) -> int:
        """`flops` of a use that reads `reads` (the declared inputs and streams it names, by
        argument): what a layer computes from them besides its input (cross-attention's keys)."""
        return self.flops(a, x, y)

    def flops(self, a: A, x: TensorType, y: TensorType) -> int:
        """Forward FLOPs for the whole (global) batch, by one convention for every kind.

        A matrix product costs two per multiply-add. The elementwise work around it counts
        too, one per element per operation, the way each rule estimates it (a norm, an
        activation function, the loss): so a bias add costs one FLOP per element of the
        output it is added to, b·s per bias element on [b, s, ...] (`bias_add_flops`), in
        every kind that has one (linear, conv, attention, layernorm), and so does adding a
        learned position embedding. Published counts (Narayanan et al.'s
        96·B·s·l·h²·(1 + s/6h + V/16lh)) keep the matrix products alone; what the rules add is
        a small fraction of them (docs/plan.md compares the two on GPT-3)."""
        return 0

    # ---- activation memory: the planner's model (dslc/plan/activations.py, docs/plan.md) ----
    #
    # Bytes on one device for one of `slices` equal slices of the batch (microbatches), in the
    # compute dtype `compute`. They follow what `jax.vjp` saves for the layer's kernel: a matrix
    # product keeps its operand (for the weight's gradient), a nonlinearity its input and its
    # own intermediates, a softmax its output; normalisation and the loss compute in f32
    # whatever the compute dtype.

    def residual_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """What autodiff keeps for the layer's backward pass. By default its input and output."""
        y = layer.output.slice_numel(mesh, slices) if layer.output.rank else 1
        return (layer.input.slice_numel(mesh, slices) + y) * DTYPE_BYTES[compute]

    def recomputed_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """What recomputing the layer inside a checkpointed block's backward materialises. XLA
        fuses an elementwise chain into the backward ops that read it, so a rule whose
        residuals are such a chain's terms (GELU's, a norm's f32 copies) says less here than
        in `residual_bytes`, which is what a saved forward keeps. By default the same."""
        return self.residual_bytes(layer, mesh, compute, slices)

    def workspace_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The largest transient while the layer's backward runs, on top of its residuals. By
        default their gradients, which live next to the residuals themselves: the same size."""
        return self.residual_bytes(layer, mesh, compute, slices)

    # ---- its core: what `checkpoint core_attention` recomputes rather than keeps ----------
    #
    # A layer may have a core whose activations are large and cheap to recompute (attention's
    # scores, softmax and weighted sum: Korthikanti et al.'s selective recomputation). Its
    # kernel then takes `recompute_core`, and the backward pass reruns the core.

    def core_flops(self, layer: Layer) -> int:
        """FLOPs the backward pass spends rerunning the core, for the whole batch (what of its
        forward the gradients read); 0: no core to recompute."""
        return 0

    def core_bytes(self, layer: Layer, mesh: Mesh, compute: str, slices: int) -> int:
        """The part of `residual_bytes` that recomputing the core saves."""
        return 0

    def no_core_note(self, layer: Layer) -> str | None:
        """Why this use has no core to recompute though its kind may have one (a note for
        `checkpoint core_attention` on a block without one); None otherwise."""
        return None

    # ---- what the planner and the checker ask of a checked use ---------------------------

    # True for a loss: the end of the forward pass. Its collectives reduce its statistics,
    # whose gradient is local once the forward has them: they have no backward.
    is_loss: ClassVar[bool] = False

    def backward_collectives(self, layer: Layer, mesh: Mesh) -> tuple[Collective, ...]:
        """What the layer's backward pass sends besides the transposes of its forward
        collectives (`Layer.collectives`)."""
        return ()

    def pipeline_recompute_collectives(self, layer: Layer) -> tuple[Collective, ...]:
        """What the layer sends again in its backward pass because it runs inside the
        pipeline's `shard_map`."""
        return ()

    def context_axes(self, layer: Layer, mesh: Mesh) -> Axes:
        """The mesh axes over which the layer sees only its share of the tokens (context
        parallelism): every gradient is then all-reduced over them as well."""
        return ()

    def pipeline_refusal(self, layer: Layer) -> str | None:
        """Why this use cannot run inside a pipeline stage, completing "`path` ..."; None
        when it can."""
        return None

    def kernel(self, a: A, operand: Sharding) -> str:
        """The function in `dslc.runtime.layers` that computes this use of the layer (both
        backends call it the same way, see that module's conventions): by default the
        kind's own name; a rule may choose by sharding (attention over a split sequence is
        ring attention)."""
        return self.kind

    # True when the kernel draws random numbers: it then takes `key` (None when evaluating).
    random: ClassVar[bool] = False

    def draws(self, layer: Layer) -> bool:
        """Whether this use draws random numbers while training (a `random` kind may be told
        not to: dropout at rate 0 is the identity)."""
        return self.random

    # For a loss that is a mean over the positions it counts (cross-entropy leaves out ignored
    # targets): the function of `dslc.runtime.layers` that counts them, called with the loss
    # kernel's inputs and static arguments. Gradient accumulation weighs each slice of the
    # batch by its count, so the mean is the whole batch's. None: every slice weighs the same.
    count_kernel: ClassVar[str | None] = None

    # True when the kernel returns (y, aux) rather than y: aux is a dict of f32 scalars, summed
    # over the layers that return one. Its "aux_loss" entry is added to the training loss (and
    # so differentiated); the others are counts reported as they are (a mixture of experts'
    # dropped tokens).
    has_aux: ClassVar[bool] = False

    def kernel_args(self, a: A, dtype: str, operand: Sharding, weights: Mapping[str, Sharding]) -> dict[str, object]:
        """The kernel's static keyword arguments; `dtype` names the compute dtype ("bfloat16"),
        `operand` is the sharding of the input as the layer computes on it, `weights` the
        sharding of each of its weights.

        Arguments of type "input" are not listed here: the caller passes the named input's
        array under the argument's own name.
        """
        return {}

    def sized_args(self, a: A, x: TensorType, operand: Sharding) -> dict[str, object]:
        """Static keyword arguments that depend on the input's shape `x` as well (attention's
        core algorithm, chosen by sequence length, and its block)."""
        return {}


def input_args(rule: LayerRule[Any], attrs: Mapping[str, object]) -> dict[str, str]:
    """The declared inputs and streams one use of a layer reads, by argument name (an optional
    input argument left out, such as a loss's `mask`, is not listed)."""
    return {
        arg.name: str(attrs[arg.name])
        for arg in rule.args
        if arg.type in ("input", "stream") and attrs[arg.name] is not None
    }


F32 = 4  # bytes of the f32 copies that normalisation and the losses compute in


def bias_add_flops(positions: int, width: int) -> int:
    """FLOPs of adding biases `width` elements wide in all at each of `positions` positions
    (tokens, pixels): one per element added (`LayerRule.flops`); a width of 0 is no bias."""
    return positions * width


def operand_numel(layer: Layer, mesh: Mesh, slices: int) -> int:
    """Elements of the layer's input as it computes on it (after a sequence-parallel gather),
    on one device for one slice of the batch."""
    operand = TensorType(layer.input.dtype, layer.input.shape, layer.operand or layer.input.sharding)
    return operand.slice_numel(mesh, slices)


# ---- shared sharding algebra --------------------------------------------------------------------


def fmt_axes(axes: Axes) -> str:
    if not axes:
        return "replicated"
    return "`" + axes[0] + "`" if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def expect_features(ctx: Context, x: TensorType, expected: int, what: str, dim: int = -1) -> bool:
    if x.rank == 0 or x.shape[dim] != expected:
        got = "a scalar" if x.rank == 0 else f"{x.shape[dim]} in {x.describe()}"
        ctx.error(
            "E016",
            f"`{ctx.path}` expects {expected} {what}, but its input has {got}",
            labels=[Label(ctx.input_span, f"input produced here: {x.describe()}")],
            help=f"make the {what} of this layer match its input ({x.shape[dim] if x.rank else '?'})",
        )
        return False
    return True


def gather_dims(ctx: Context, x: TensorType, axes: Axes, upto: int, why: str) -> TensorType:
    """All-gather the dimensions of `x` (before `upto`) that are split over `axes`.

    This is how Megatron sequence parallelism enters a tensor-parallel region: the tokens
    were split over the tensor-parallel axis and must be whole again before the weights,
    which are split over that same axis, see them.
    """
    sharding = list(x.sharding)
    for i in range(upto):
        hit = tuple(a for a in sharding[i] if a in axes)
        if hit:
            ctx.collective("all-gather", hit, x, why)
            sharding[i] = tuple(a for a in sharding[i] if a not in axes)
    return TensorType(x.dtype, x.shape, tuple(sharding))


def contract(
    ctx: Context,
    x: TensorType,
    kernel: TensorType,
    kernel_name: str,
    out_dtype: str,
    is_input: bool = True,
) -> TensorType | None:
    """Type `x[..., K] @ kernel[K, N]`: Megatron's column/row-parallel algebra.

    * K split over the same axes in both: a row-parallel partial sum, all-reduced over them.
    * K whole in `x` but split in the kernel: each device slices its part of `x` for free.
    * K split in `x` but not (or differently) in the kernel: refused, because it would need a
      hidden all-gather of the activation, or would silently compute the wrong sum.
    * N split in the kernel: a column-parallel output, split the same way.
    """
    k_in, k_out = kernel.sharding[0], kernel.sharding[-1]
    x_k = x.sharding[-1]
    if x_k and x_k != k_in:
        ctx.error(
            "E017",
            f"contraction shardings of `{ctx.path}` do not line up: its input's features are "
            f"split over {fmt_axes(x_k)} but `{kernel_name}`'s input dimension is "
            f"{'split over ' + fmt_axes(k_in) if k_in else 'replicated'}",
            at=ctx.weight_span(kernel_name),
            labels=[Label(ctx.input_span, f"features split over {fmt_axes(x_k)} here")],
            help=f"shard `{kernel_name}` as [{', '.join([_bracket(x_k)] + ['_'] * (kernel.rank - 1))}] "
            "(row parallel), or gather the activation first with `layout`",
        )
        return None
    x = gather_dims(ctx, x, k_in + k_out, x.rank - 1, f"`{ctx.path}`: gather tokens (sequence parallel)")
    if is_input:
        ctx.operand = x.sharding
    out_shape = (*x.shape[:-1], kernel.shape[-1])
    out = TensorType(out_dtype, out_shape, (*x.sharding[:-1], k_out))
    if k_in:
        ctx.collective("all-reduce", k_in, out, f"`{ctx.path}`: sum of row-parallel partial products")
    return out


def _bracket(axes: Axes) -> str:
    return axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"


def same_sharding(ctx: Context, name: str, t: TensorType, dim: int, want: Axes, why: str) -> bool:
    got = t.sharding[dim]
    if got != want:
        ctx.error(
            "E017",
            f"`{name}` of `{ctx.path}` is {'split over ' + fmt_axes(got) if got else 'replicated'} "
            f"but must be {'split over ' + fmt_axes(want) if want else 'replicated'}: {why}",
            at=ctx.weight_span(name),
            # A vector (a bias) has one way to be right; for matrices the message says which.
            help=f"shard it as `{name}[{_bracket(want)}]`" if want and t.rank == 1 else None,
        )
        return False
    return True
