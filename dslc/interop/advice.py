"""Only the fixes that are needed, when config.json disagrees with the spec.

Each disagreeing key is reported, and most come with the `--set` that fixes them. But sizes
follow from one another: specs/gpt2.par declares `const ffn = 4 * d`, so `--set d=1024`
makes the MLP 4096 wide as well, and a Llama attention's head width is `d / heads` unless it
is written. Advising a `--set ffn=...`, or an edit of the spec, for what the other `--set`s
already fix would send the user to change what needs no change.

So the suggested `--set`s are tried on the spec itself: it is elaborated again (the front end
alone, in milliseconds) with them applied on top of the ones it was given, and the config's
facts are compared again. A suggested `--set` whose key the others fix without it is left
out, later constants first (a constant is defined from those before it, so the later one is
the one that may follow); every key the remaining `--set`s fix is then reported with a note
naming them instead of a fix of its own. Only what disagrees after all of them keeps its
edit of the spec. Where the spec cannot be elaborated with them, every fix is kept as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dslc.diagnostics import Diagnostics
from dslc.elaborate import elaborate, read_constants
from dslc.frontend import Analysis, check_overrides
from dslc.interop.errors import CheckpointError
from dslc.interop.mapping import Disagreement, Fact, declared_constants, same, set_flag
from dslc.ir import nodes as ir
from dslc.ir.evaluate import ScalarValue

# The facts a config states, compared with a spec's program (the family's `facts`, matched).
FactsOf = Callable[[ir.Program], list[Fact]]


def follows(found: Sequence[Disagreement], analysis: Analysis, facts_of: FactsOf) -> dict[str, str]:
    """The keys of `found` that need no fix of their own, each with the suggested `--set`s
    that fix it (as the command line writes them); see the module."""
    sets = {d.setting[0]: d.setting[1] for d in found if d.setting is not None}
    if not sets:
        return {}
    order = list(declared_constants(analysis))
    sets = dict(sorted(sets.items(), key=lambda item: order.index(item[0])))
    given = given_overrides(analysis)

    def left(chosen: Mapping[str, object]) -> frozenset[str] | None:
        """The keys that still disagree with these `--set`s applied; None when the spec does
        not elaborate with them."""
        program = _elaborated(analysis, {**given, **chosen})
        if program is None:
            return None
        try:
            facts = facts_of(program)
        except CheckpointError:  # no longer built like the family: nothing to conclude
            return None
        return frozenset(f.key for f in facts if not same(f.config, f.spec))

    remaining = left(sets)
    if remaining is None:
        return {}
    kept = dict(sets)
    for name in reversed(sets):
        trial = {k: v for k, v in kept.items() if k != name}
        if left(trial) == remaining:
            kept = trial
    out: dict[str, str] = {}
    for d in found:
        key = d.fact.key
        if key in remaining or (d.setting is not None and d.setting[0] in kept):
            continue
        out[key] = _fixed_by(key, kept, left)
    return out


def _fixed_by(
    key: str, kept: Mapping[str, object], left: Callable[[Mapping[str, object]], frozenset[str] | None]
) -> str:
    """The kept `--set`s that fix `key`, none of them idle: the width's for the MLP's width,
    the width's and the heads' together for a head's width, not the number of layers'."""
    chosen = dict(kept)
    for name in kept:
        trial = {k: v for k, v in chosen.items() if k != name}
        still = left(trial) if trial else None
        if still is not None and key not in still:
            chosen = trial
    return " ".join(set_flag(name, value) for name, value in chosen.items())


def given_overrides(analysis: Analysis) -> dict[str, ScalarValue]:
    """The constants the spec was given on the command line (`--set`), told from its program:
    walking the declarations in order, a constant whose value is not what its declaration
    gives (with the overrides found so far) was set. A constant set to exactly the value it
    would have is not told apart (it matters only where a constant it is defined from gets a
    `--set` suggested: then the advice takes it to follow)."""
    program = analysis.program
    assert analysis.module is not None and program is not None
    actual = dict(program.constants)
    given: dict[str, ScalarValue] = {}
    for name in declared_constants(analysis):
        if name not in actual:
            continue
        written = read_constants(analysis.module, given, Diagnostics()).get(name)
        if written is None or not same(written, actual[name]):
            given[name] = actual[name]
    return given


def _elaborated(analysis: Analysis, values: Mapping[str, object]) -> ir.Program | None:
    """The spec's program with these constants, if it elaborates without errors, on a mesh
    of one device per axis: whether the sizes split over the spec's mesh (3 layers over 2
    stages, say) is not what is asked here, and a `--set` the config needs stays needed when
    the mesh must change too. The sizes the config is compared with are the same on any mesh."""
    assert analysis.module is not None and analysis.program is not None
    scalars = {k: v for k, v in values.items() if isinstance(v, bool | int | float)}
    if len(scalars) != len(values):
        return None
    try:
        overrides = check_overrides(analysis.module, scalars)
    except ValueError:  # a value of another kind than the constant's
        return None
    collected = Diagnostics()
    ones = (1,) * len(analysis.program.mesh.shape)
    program = elaborate(analysis.module, ones, collected, overrides)
    return None if program is None or collected.has_errors else program
