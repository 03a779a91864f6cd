"""What pipeline chunks hand each other: shapes of one microbatch, and the shared buffer."""

from __future__ import annotations

from dslc.ir import nodes as ir


def chunk_input(chunk: ir.Chunk, microbatches: int) -> tuple[int, ...]:
    """The shape of one microbatch of a chunk's input."""
    t = chunk.nodes[0].input
    return (t.shape[0] // microbatches, *t.shape[1:])


def boundary_of(program: ir.Program, microbatches: int) -> tuple[tuple[int, ...], str | None]:
    """One microbatch of the widest tensor handed between chunks, and its dtype (None when
    there is a single chunk).

    Stages of one model may hand over tensors of different widths (784 -> 512 -> 256); they
    share a buffer padded to the widest, and each chunk reads its own slice.
    """
    outs = [chunk.nodes[-1].output for chunk in program.chunks[:-1] if chunk.nodes]
    if not outs:
        return (1,), None
    rank = outs[0].rank
    assert all(t.rank == rank for t in outs), "the checker keeps stage boundaries of one rank"
    shape = tuple(max(t.shape[i] for t in outs) for i in range(rank))
    return (shape[0] // microbatches, *shape[1:]), outs[0].dtype
