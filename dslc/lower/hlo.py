"""The collectives of a compiled step, read from its optimized HLO text: what each one moves,
over which mesh axes, and inside which loops and conditionals it sits.

The text is what `jax.jit(f).lower(...).compile().as_text()` prints (`Program.lower(...)`
gives the lowered step). A collective's replica groups name devices by their place in the
mesh's device list, so the axes along which a group's members differ are the axes it runs
over. Its loops are found by following the calls from the entry computation: a while loop's
body (with the trip count XLA proved, `known_trip_count`), a conditional's branches, and any
other computation an instruction calls.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dslc.ir.nodes import DTYPE_BYTES
from dslc.plan.communication import ring_bytes
from dslc.runtime.pipeline import STAGE_BRANCHES

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# HLO element types -> bytes (the IR's names where they differ).
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8}
_ELEMENT_BYTES |= {name: size for name, size in DTYPE_BYTES.items() if name.startswith(("f", "bf"))}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (?P<type>.*?) (?P<op>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[suf]\d+|bf16)\[(?P<dims>[\d,]*)\]")
_CALLED = re.compile(r"\b(?:condition|body|to_apply|calls)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(
    r"branch_computations=\{(?P<names>[^}]*)\}"
    r"|true_computation=%(?P<true>[\w.\-]+), false_computation=%(?P<false>[\w.\-]+)"
)
_NAME = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) =")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_BODY = re.compile(r"\bbody=%(?P<name>[\w.\-]+)")
_EXPLICIT_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?\s*\{(?P<over>[^}]*)\}"
)
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective instruction of the compiled step, as one device runs it.

    `results` are its result arrays (dtype, dimensions), per device; `groups` the devices
    (by place in the mesh) that run it together; `loops` the trip counts of the while loops
    around it, outermost first (0 where XLA could not prove one); `branches` the conditionals
    around it, outermost first, each as (its instruction's name, the index of the branch
    holding the collective), a branch running only when taken; `op_name` the jax operation
    it came from (`.../while/body/.../transpose(jvp(...))/...`)."""

    kind: str
    results: tuple[tuple[str, tuple[int, ...]], ...]
    groups: tuple[tuple[int, ...], ...]
    loops: tuple[int, ...]
    branches: tuple[tuple[str, int], ...]
    op_name: str

    @property
    def group_size(self) -> int:
        return max((len(g) for g in self.groups), default=1)

    @property
    def result_bytes(self) -> int:
        return sum(_ELEMENT_BYTES[dtype] * math.prod(dims) for dtype, dims in self.results)

    @property
    def tensor_bytes(self) -> int:
        """The bytes of the whole tensor one group works on (a reduce-scatter's input)."""
        return self.result_bytes * (self.group_size if self.kind == "reduce-scatter" else 1)

    @property
    def sent_bytes(self) -> int:
        """Bytes one device sends each time it runs, by the ring algorithms the planner assumes."""
        return ring_bytes(self.kind, self.group_size, self.tensor_bytes)

    @property
    def in_loop(self) -> bool:
        return bool(self.loops)

    def axes(self, axis_names: Sequence[str], shape: Sequence[int]) -> tuple[str, ...]:
        """The mesh axes along which the devices of a group differ."""
        if not self.groups:
            return tuple(axis_names)  # one group of every device
        varying: set[int] = set()
        for group in self.groups:
            coords = np.array(np.unravel_index(list(group), tuple(shape))).T
            varying |= {i for i in range(len(shape)) if len(set(coords[:, i])) > 1}
        return tuple(axis_names[i] for i in sorted(varying))


def collectives(text: str) -> list[Collective]:
    """Every collective of a compiled module's HLO text, each as reached from its entry
    computation (one reached along two call paths is listed twice)."""
    computations, entry = _computations(text)
    found: list[Collective] = []

    def visit(name: str, loops: tuple[int, ...], branches: tuple[tuple[str, int], ...], seen: frozenset[str]) -> None:
        if name not in computations or name in seen:
            return
        inner = frozenset({*seen, name})
        for line in computations[name]:
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            op = match["op"].removesuffix("-start")
            if op in KINDS:
                found.append(
                    Collective(op, _results(match["type"], op), _groups(line), loops, branches, _op_name(line))
                )
            body = _BODY.search(line)
            trips = _TRIPS.search(line)
            for called in _CALLED.finditer(line):
                if body is not None and called["name"] == body["name"]:
                    visit(called["name"], (*loops, int(trips["n"]) if trips else 0), branches, inner)
                else:
                    visit(called["name"], loops, branches, inner)
            alternatives = _BRANCHES.search(line)
            if alternatives is not None:
                here = _NAME.match(line)
                conditional = here["name"] if here else ""
                names = alternatives["names"]
                called_names = names.split(",") if names is not None else [alternatives["true"], alternatives["false"]]
                for index, called_name in enumerate(called_names):
                    visit(called_name.strip().lstrip("%"), loops, (*branches, (conditional, index)), inner)

    visit(entry, (), (), frozenset())
    return found


def stalling(
    found: Sequence[Collective], axis_names: Sequence[str], shape: Sequence[int], stage_axis: str
) -> list[Collective]:
    """The collectives inside the pipeline executor's per-stage branches (its switches, where
    each stage takes the branch of its own op) that would wait for devices of another stage:
    one whose groups span the stage axis, or a collective-permute, which XLA runs as one
    exchange among every device it names. Each stage taking a different branch, such a
    collective never completes (XLA's CPU backend aborts after 40 s)."""
    return [
        c
        for c in found
        if f"/{STAGE_BRANCHES}/" in c.op_name
        and (c.kind == "collective-permute" or stage_axis in c.axes(axis_names, shape))
    ]


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry = ""
    current: list[str] | None = None
    for line in text.splitlines():
        start = _COMPUTATION.match(line)
        if start is not None:
            current = computations.setdefault(start["name"], [])
            if line.startswith("ENTRY "):
                entry = start["name"]
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return computations, entry


def _results(type_text: str, op: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    arrays = [(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d)) for m in _ARRAY.finditer(type_text)]
    if op == "all-gather" and len(arrays) == 2 and type_text.startswith("("):
        return (arrays[1],)  # the asynchronous form's (operand, result)
    return tuple(arrays)


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups in any of the forms XLA prints: listed (`{{0,8},{1,9}}`), an iota
    (`[8,2]<=[2,4,2]T(2,1,0)`), or the axes of a mesh (`mesh['a'=2,'b'=4] {'a'}`, its devices
    in iota order or as `device_ids=(...)` says); empty for one group of every device."""
    over_mesh = _MESH_GROUPS.search(line)
    if over_mesh is not None:
        axes = [entry.split("=") for entry in over_mesh["axes"].split(",")]
        names, sizes = [name.strip("' ") for name, _ in axes], [int(size) for _, size in axes]
        over = [names.index(name.strip("' ")) for name in over_mesh["over"].split(",") if name.strip()]
        others = [i for i in range(len(names)) if i not in over]
        ids = _iota(over_mesh["dims"] or ",".join(map(str, sizes)), over_mesh["perm"]).reshape(sizes)
        return _rows(ids.transpose(others + over), math.prod(sizes[i] for i in over))
    iota = _IOTA_GROUPS.search(line)
    if iota is not None:
        shape = [int(n) for n in iota["shape"].split(",")]
        return _rows(_iota(iota["dims"], iota["perm"]), shape[-1])
    explicit = _EXPLICIT_GROUPS.search(line)
    if explicit is not None:
        return tuple(
            tuple(int(i) for i in group.split(",") if i) for group in re.findall(r"\{([\d,]*)\}", explicit["groups"])
        )
    if "replica_groups=" in line:
        raise ValueError(f"replica groups in a form this reader does not know: {line.strip()[:200]}")
    return ()


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(n) for n in dims.split(","))).reshape([int(n) for n in dims.split(",")])
    return ids.transpose([int(n) for n in perm.split(",")]) if perm else ids


def _rows(ids: np.ndarray, size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))


def _op_name(line: str) -> str:
    match = _OP_NAME.search(line)
    return match["name"] if match else ""
