"""Weight shapes and initializers as the spec's constants compute them: the `PARAMETERS`
table says `(D, KV_HEADS * (D // HEADS))` where it would otherwise say `(2048, 256)`.

A layer's integer arguments, where the spec wrote them in its constants, become `Spelled`
integers: each is its value and the code computing it, and arithmetic on them builds both. The
rule's own `weights` then runs on them unchanged, so a shape is spelled by the same formula
that sized it; a dimension that comes out as a plain number (a literal, padding) stays one.
A weight initialised by its fan-in is written `fan_in(D)` the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from dslc.codegen.view import Code
from dslc.ir import nodes as ir
from dslc.ir.placement import StoredArray
from dslc.layers import RULES
from dslc.layers.base import WeightSpec, arg_field
from dslc.runtime.storage import fan_in

# An argument as the spec wrote it -> the module's code for it (`Builder.code`), or None.
Speller = Callable[[str], Code | None]

# How tightly each operator binds, to bracket an operand only where Python needs it.
_ATOM, _PRODUCT, _SUM = 3, 2, 1


class Spelled(int):
    """An integer with the Python code that computes it from the spec's constants."""

    code: str
    level: int
    # `a // b` remembers (a, b): `b * (a // b)` is `a` again where the division was exact
    # (attention's `heads * head_dim`, head_dim being dim // heads, is dim).
    quotient: tuple[int, int] | None

    def __new__(cls, value: int, code: str, level: int = _ATOM) -> Spelled:
        out = super().__new__(cls, value)
        out.code, out.level, out.quotient = code, level, None
        return out

    def _op(self, op: str, other: object, level: int, value: int, swap: bool = False) -> Spelled:
        left, right = (other, self) if swap else (self, other)
        return Spelled(value, f"{_operand(left, level, False)} {op} {_operand(right, level, True)}", level)

    # Arithmetic with another integer keeps the code; anything else (a float) gets Python's
    # plain arithmetic, through its own reflected operator.
    def __mul__(self, other: int) -> int:
        return self._product(other, swap=False)

    def __rmul__(self, other: int) -> int:
        return self._product(other, swap=True)

    def _product(self, other: int, swap: bool) -> int:
        if not _integer(other):
            return NotImplemented
        if other == 1 and not isinstance(other, Spelled):
            return self  # math.prod's start
        value = int(self) * other
        return _undivided(self, other) or _undivided(other, self) or self._op("*", other, _PRODUCT, value, swap)

    def __floordiv__(self, other: int) -> int:
        if not _integer(other):
            return NotImplemented
        out = self._op("//", other, _PRODUCT, int(self) // other)
        out.quotient = (self, other)
        return out

    def __add__(self, other: int) -> int:
        return self._op("+", other, _SUM, int(self) + other) if _integer(other) else NotImplemented

    def __radd__(self, other: int) -> int:
        return self._op("+", other, _SUM, other + int(self), swap=True) if _integer(other) else NotImplemented

    def __sub__(self, other: int) -> int:
        return self._op("-", other, _SUM, int(self) - other) if _integer(other) else NotImplemented


def _undivided(factor: int, product: int) -> int | None:
    """`factor * (a // factor)` as `a`, where that is what it equals."""
    if isinstance(product, Spelled) and product.quotient is not None:
        a, b = product.quotient
        if _same(b, factor) and int(a) == int(factor) * int(product):
            return a
    return None


def _same(x: int, y: int) -> bool:
    return isinstance(x, Spelled) and isinstance(y, Spelled) and x.code == y.code


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _operand(x: object, level: int, right: bool) -> str:
    if isinstance(x, Spelled):
        return f"({x.code})" if x.level < level or (right and x.level == level) else x.code
    return repr(x)


def spelled_weight(layer: ir.Layer, weight: str) -> WeightSpec | None:
    """`layer`'s weight `weight` as its rule declares it, each dimension of its shape (and its
    fan-in) `Spelled` in the spec's own names where the spec wrote what computes it; None when
    the rule has no such weight."""
    rule = RULES[layer.kind]
    values = dict(layer.attrs)
    written = dict(layer.written)
    for spec in rule.args:
        value = values.get(spec.name)
        if spec.type != "int" or not _integer(value):
            continue
        assert isinstance(value, int)
        if spec.name in written:
            text = written[spec.name]
            # A name or a number stands alone; anything longer is bracketed where it is put.
            alone = text.isidentifier() or text.isdigit()
            values[spec.name] = Spelled(value, text, _ATOM if alone else _SUM - 1)
        elif callable(spec.default):
            # A default computed from the arguments before it (head_dim = dim // heads):
            # computed again on their spellings, and kept only where it comes out the same.
            again = spec.default(values)
            if _integer(again) and again == value:
                values[spec.name] = again
    typed = rule.Args(**{arg_field(name): v for name, v in values.items()})
    return next((w for w in rule.weights(typed) if w.name == weight), None)


def _declared(program: ir.Program, array: StoredArray) -> WeightSpec | None:
    """The weight `array` stores as its layer's rule declares it, spelled in the spec's
    constants (`spelled_weight`); None for an array of several weights or per-stage rows."""
    if array.rows or "|" in array.name:
        return None
    path, _, weight = array.name.replace("*.", "").rpartition(".")
    layer = next((x for x in ir.all_layers(program) if x.path == path), None)
    return spelled_weight(layer, weight) if layer is not None else None


def spelled_shape(program: ir.Program, code: Speller, array: StoredArray) -> list[str]:
    """Each dimension of `array` as code: in the spec's constants where they compute it (a
    layer's weight by its rule's formula, a repeat's layers by its count), else its number
    (a padded vocabulary, a per-stage array's rows, arrays holding several weights)."""
    shape = array.type.shape
    out = [str(n) for n in shape]
    declared, lead = _declared(program, array), array.lead
    if declared is not None and len(declared.shape) == len(shape) - lead:
        for i, n in enumerate(declared.shape):
            if isinstance(n, Spelled) and n == shape[lead + i]:
                out[lead + i] = code(n.code) or out[lead + i]
    if array.layers == (1,):
        # A repeat's layers, stacked: the whole run's length, as the spec wrote it (each
        # pipeline stage's share of the run is a node of its own, written alike).
        prefix = array.name[: array.name.index(".*.")]
        runs = [n for n in ir.walk(program.nodes) if isinstance(n, ir.Repeat) and n.path == prefix]
        if runs and runs[0].written and runs[0].length == shape[0]:
            out[0] = code(runs[0].written) or out[0]
    return out


def spelled_init(program: ir.Program, code: Speller, array: StoredArray) -> str | None:
    """`array`'s initializer as code: `fan_in(D)` (the runtime's, giving the same "normal:STD")
    for a weight initialised by its fan-in; None for any other (its text is its code)."""
    declared = _declared(program, array)
    if declared is None or declared.init != "fan_in":
        return None
    n = declared.inputs
    if fan_in(int(n), declared.gain) != array.init:
        return None
    text = (code(n.code) if isinstance(n, Spelled) else None) or str(int(n))
    return f"fan_in({text})" if declared.gain == 1.0 else f"fan_in({text}, gain={declared.gain!r})"
