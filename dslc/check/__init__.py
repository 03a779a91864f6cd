"""Whole-program checks on the IR, run in order after elaboration.

Each pass takes the program and a diagnostics collector and reports what it finds; none of
them changes the program.
"""

from __future__ import annotations

from collections.abc import Callable

from dslc.check.advice import check_balance, check_efficiency, check_replication
from dslc.check.batch import check_batch
from dslc.check.schedule import check_pipelined_kernels, check_schedule
from dslc.check.zero import check_zero
from dslc.diagnostics import Diagnostics
from dslc.ir.nodes import Program

PASSES: tuple[Callable[[Program, Diagnostics], None], ...] = (
    check_batch,
    check_schedule,
    check_pipelined_kernels,
    check_efficiency,
    check_balance,
    check_replication,
    check_zero,
)


def check_program(program: Program, diags: Diagnostics) -> None:
    for run in PASSES:
        run(program, diags)
