"""The buffers a schedule needs, and the slot every value lives in: the executor's tables.

`dslc.runtime.schedule.slot_tables` makes them (its docstring says what a stage keeps, and
for how long), the very code the generated module makes its own tables with; `ExecutionPlan`
is how dslc reads them.

Where received values come from. In a tick a stage makes at most one value for another chunk:
a forward's output (the next chunk's input activation) or a `B`'s or `I`'s input gradient (the
previous chunk's output gradient). It goes to the stage that holds that chunk, which the
placement puts on the next stage, the previous one, or the same stage (`table.direction`; the
stages form a ring, so the last stage's next is the first). At the end of the tick the receiver
stores it in a slot of its activations or of its gradients, whichever direction it came from.
Every value has exactly one receiver, so an executor may send each tick's value both ways round
the ring and let these tables pick what is kept. Per tick and stage, -1 where nothing arrives:

  receive_activation                         the activation arriving from stage - 1
  receive_gradient                           the gradient arriving from stage + 1
  other_directions.activation_from_next      the activation arriving from stage + 1 (a V going up)
  other_directions.gradient_from_previous    the gradient arriving from stage - 1 (a V going down)
  other_directions.keep_activation           the activation this stage made for its own next chunk
                                             (a V's turn)
  other_directions.keep_gradient             the gradient this stage made for its own previous chunk

A ring placement (one chunk per stage, or interleaved) sends every activation to the next stage
and every gradient to the previous one, so only the first two are ever set there
(`ExecutionPlan.ring_only`): an executor that passes activations forward and gradients backward
round the ring reads the `Table` fields of `ExecutionPlan` and nothing else.

The executor runs in lockstep (SPMD), so every stage gets buffers of the largest stage's
size. Everything here is static: the executor only indexes these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslc.runtime.schedule import OTHER_DIRECTIONS, TABLE_ENTRIES, slot_tables
from dslc.schedules.table import Schedule

Table = tuple[tuple[int, ...], ...]  # [tick][stage]


@dataclass(frozen=True, slots=True)
class OtherDirections:
    """Arrivals a ring placement never has: per (tick, stage), the slot to store them in, or -1."""

    activation_from_next: Table
    gradient_from_previous: Table
    keep_activation: Table
    keep_gradient: Table


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Per (tick, stage): what to do, on what, which slots to read, and where arrivals go."""

    ticks: int
    stages: int
    op: Table
    microbatch: Table
    chunk: Table
    stash_slot: Table  # F writes the chunk input here; B / I / W read it
    activation_slot: Table  # F reads its received input here (not chunk 0)
    gradient_slot: Table  # B / I / W read the received output gradient here (not the last chunk)
    receive_activation: Table  # at the end of the tick, store the activation arriving from stage - 1 here
    receive_gradient: Table  # at the end of the tick, store the gradient arriving from stage + 1 here
    other_directions: OtherDirections
    stash_slots: int
    activation_slots: int
    gradient_slots: int

    @property
    def ring_only(self) -> bool:
        """Whether every activation goes to the next stage and every gradient to the previous
        one, so that the `Table` fields say everything."""
        others = self.other_directions
        tables = (
            others.activation_from_next,
            others.gradient_from_previous,
            others.keep_activation,
            others.keep_gradient,
        )
        return all(cell < 0 for table in tables for row in table for cell in row)


def allocate_slots(schedule: Schedule) -> ExecutionPlan:
    """The executor's tables for `schedule`, which must pass `validate`: the ones the generated
    module makes from its timelines, by the same code (`dslc.runtime.schedule.slot_tables`)."""
    tables = slot_tables(
        [[None if a is None else (a.op, a.microbatch, a.chunk) for a in row] for row in schedule.grid()]
    )

    def table(name: str) -> Table:
        return tuple(tuple(row) for row in tables[name])

    def slots(name: str) -> int:
        return 1 + max(max(row) for row in tables[name])

    return ExecutionPlan(
        ticks=schedule.ticks,
        stages=schedule.stages,
        **{name: table(name) for name in TABLE_ENTRIES},
        other_directions=OtherDirections(**{name: table(name) for name in OTHER_DIRECTIONS}),
        stash_slots=slots("stash_slot"),
        activation_slots=slots("activation_slot"),
        gradient_slots=slots("gradient_slot"),
    )
