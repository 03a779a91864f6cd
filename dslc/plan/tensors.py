"""`dslc show`: every weight and activation with its sharding, and the collectives each layer implies.

The per-layer view behind `dslc plan`'s totals, read from the IR alone (no jax): for each
layer in the order it runs (a repeat's block once, for all its copies), its weights as each
device stores them — the array that holds them (a repeat's weights stacked, `blocks.*.attn.q`;
a pipeline stage's own layers or rows), with the spec's sharding, the stage axis where the
pipeline splits the array, and ZeRO-3's / FSDP's data axes where they split it further — its
output activation, each with its partition spec as jax writes it, its global and per-device
shape and its bytes per device, and the collectives its sharding implies in the forward pass.
Each stored array's bytes count once, where it is first used: they add up to the plan's
`params`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dslc.ir import nodes as ir
from dslc.ir.placement import place
from dslc.ir.schedule import microbatch_slices
from dslc.layers.inputs import UNPACKED, Packing, packing
from dslc.plan.report import format_bytes


def partition_spec(sharding: ir.Sharding) -> str:
    """A sharding as jax's PartitionSpec prints it: `P(None, 'model')`, `P(('data', 'fsdp'),)`."""
    dims = ["None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes) for axes in sharding]
    return f"P({', '.join(dims)}{',' if len(dims) == 1 else ''})"


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor as the devices hold it."""

    name: str
    type: ir.TensorType  # the global shape and dtype, with the sharding it is stored in
    computed: ir.Sharding  # the sharding a layer computes with (one copy's weight, gathered)
    mesh: ir.Mesh
    stored: str = ""  # a weight: the stored array holding it
    first: bool = True  # a weight: whether this is the array's first use (its bytes count here)
    declared: tuple[int, ...] = ()  # a padded vocabulary's array: its shape without the padding

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.type.local_shape(self.mesh)

    @property
    def bytes(self) -> int:
        return self.type.local_nbytes(self.mesh)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stored": self.stored,
            "dtype": self.type.dtype,
            "partition_spec": partition_spec(self.type.sharding),
            "computed_with": partition_spec(self.computed),
            "shape": list(self.type.shape),
            "local_shape": list(self.local_shape),
            "bytes": self.bytes if self.first else 0,
            "declared_shape": list(self.declared or self.type.shape),
        }

    def cells(self, what: str) -> tuple[tuple[str, ...], str]:
        """Its row of the text table: one cell per column (`COLUMNS`), then what follows them."""
        shape = f"{self.type.dtype}[{', '.join(map(str, self.type.shape))}]"
        local = f"[{', '.join(map(str, self.local_shape))}]"
        size = format_bytes(self.bytes) if self.first else "above"
        tail = ""
        if self.stored and self.stored != self.name:
            tail += f"  in `{self.stored}`"
        if self.computed != self.type.sharding:
            tail += f"  (gathered to {partition_spec(self.computed)} to compute)"
        if self.declared:
            tail += f"  (padded from [{', '.join(map(str, self.declared))}])"
        return (what, self.name, partition_spec(self.type.sharding), shape, local, size), tail


# The text table's columns: their titles, and whether each is right-aligned (the bytes, so
# that their units line up).
COLUMNS = (
    ("", False),
    ("", False),
    ("partition spec", False),
    ("global", False),
    ("per device", False),
    ("bytes", True),
)


# A line of the text table: a tensor's cells and what follows them, or a line of its own.
TableRow = tuple[tuple[str, ...], str] | str


def _table(rows: list[TableRow]) -> list[str]:
    """Lines of a table whose columns are each as wide as their widest cell (the title's
    included), two spaces apart, so that no partition spec or shape, however long, pushes a
    row out of line; a plain string is a line of its own (a layer's name, a collective)."""
    titles = tuple(title for title, _ in COLUMNS)
    cells = [titles, *(row[0] for row in rows if not isinstance(row, str))]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]

    def line(row: tuple[str, ...], tail: str = "") -> str:
        padded = (c.rjust(w) if right else c.ljust(w) for c, w, (_, right) in zip(row, widths, COLUMNS, strict=True))
        return ("    " + "  ".join(padded)).rstrip() + tail

    return [line(titles)] + [row if isinstance(row, str) else line(*row) for row in rows]


@dataclass(frozen=True, slots=True)
class Row:
    """One layer (or layout change): where it runs, its weights, its output, its collectives."""

    path: str
    kind: str
    chunk: int
    stage: int
    weights: tuple[Tensor, ...]
    output: Tensor
    collectives: tuple[ir.Collective, ...]
    copies: int = 1  # how many times the chunk runs it (a repeat's layers: once per copy)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "chunk": self.chunk,
            "stage": self.stage,
            "copies": self.copies,
            "weights": [w.to_json() for w in self.weights],
            "output": self.output.to_json(),
            "collectives": [_collective_json(c) for c in self.collectives],
        }


def _collective_json(c: ir.Collective) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "axes": list(c.axes),
        "elements": c.elements,
        "bytes": c.elements * ir.DTYPE_BYTES[c.dtype],
        "dtype": c.dtype,
        "why": c.why,
    }


@dataclass(frozen=True, slots=True)
class Tensors:
    model: str
    mesh: ir.Mesh
    pipelined: bool
    slices: int  # a step's batch runs in this many slices (microbatches x accumulation steps)
    rows: tuple[Row, ...]
    packing: Packing = UNPACKED  # documents packed into the sequences

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights each device stores: the plan's `params`."""
        return sum(w.bytes for row in self.rows for w in row.weights if w.first)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "mesh": dict(zip(self.mesh.names, self.mesh.shape, strict=True)),
            "weight_bytes": self.weight_bytes,
            "slices": self.slices,
            "packing": {
                "segments": self.packing.segments,
                "readers": list(self.packing.readers),
                "mask": self.packing.mask,
            },
            "layers": [row.to_json() for row in self.rows],
        }

    def to_text(self) -> str:
        rows: list[TableRow] = []
        chunk = None
        for row in self.rows:
            if self.pipelined and row.chunk != chunk:
                chunk = row.chunk
                rows.append(f"chunk {row.chunk} (stage {row.stage})")
            copies = f", x{row.copies}" if row.copies > 1 else ""
            rows.append(f"  {row.path} ({row.kind}{copies})" if row.path else f"  ({row.kind}{copies})")
            rows.extend(w.cells("weight") for w in row.weights)
            rows.append(row.output.cells("output"))
            for c in row.collectives:
                size = format_bytes(c.elements * ir.DTYPE_BYTES[c.dtype])
                rows.append(f"    {c.kind} over {', '.join(c.axes)} of {size} ({c.dtype}): {c.why}")
        lines = [
            f"model {self.model} on mesh {self.mesh.describe()}: {format_bytes(self.weight_bytes)} of weights "
            "on each device"
        ]
        if self.slices > 1:
            lines.append(f"(outputs are a whole step's batch, which runs in {self.slices} slices)")
        if self.packing.describe():
            lines.append(self.packing.describe())
        return "\n".join(lines + _table(rows)) + "\n"


def layer_nodes(program: ir.Program) -> Iterator[tuple[ir.Chunk, ir.Layer | ir.Layout, int]]:
    """Every layer and layout change in the order they run, with the chunk holding it and how
    many times the chunk runs it: the one place this report walks the IR."""
    for chunk in program.chunks:
        for node, times in ir.counted(chunk.nodes):
            if isinstance(node, ir.Layer | ir.Layout):
                yield chunk, node, times


def tensors(program: ir.Program) -> Tensors:
    """The per-layer view of `program` on its mesh."""
    mesh = program.mesh
    placement = place(program)
    arrays = {a.name: a for a in placement.arrays}
    stored = {a.name: ir.TensorType(a.type.dtype, a.type.shape, a.state(program).params) for a in placement.arrays}
    # Which stored array each (chunk, weight) reads.
    holder = {
        (c, sw.layer.path, sw.weight.name): placement.shares[c][sw.name].stored
        for c, chunk in enumerate(program.chunks)
        for sw in ir.stacked_weights(chunk.nodes)
    }
    seen: set[str] = set()
    rows = []
    for chunk, node, times in layer_nodes(program):
        weights = []
        for w in node.weights if isinstance(node, ir.Layer) else ():
            name = holder[(chunk.index, node.path, w.name)]
            # ZeRO-3 and FSDP store a weight split over the data axes and gather it to compute.
            gathered = stored[name].sharding != arrays[name].type.sharding
            computed = (
                (((),) * (stored[name].rank - w.type.rank) + w.type.sharding) if gathered else stored[name].sharding
            )
            padded = arrays[name].declared if any(arrays[name].padding) else ()
            weights.append(Tensor(w.name, stored[name], computed, mesh, name, name not in seen, padded))
            seen.add(name)
        rows.append(
            Row(
                path=node.path,
                kind=node.kind if isinstance(node, ir.Layer) else "layout",
                chunk=chunk.index,
                stage=chunk.stage,
                weights=tuple(weights),
                output=Tensor("", node.output, node.output.sharding, mesh),
                collectives=node.collectives,
                copies=times,
            )
        )
    return Tensors(program.name, mesh, program.pipelined, microbatch_slices(program), tuple(rows), packing(program))
