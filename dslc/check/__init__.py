"""Whole-program checks on the IR, run in order after elaboration.

Each pass takes the program and a diagnostics collector and reports what it finds; none of
them changes the program. `RUN_PASSES` find what stops a spec from running though it can be
planned (`dslc plan` skips them).
"""

from __future__ import annotations

from collections.abc import Callable

from dslc.check.advice import check_balance, check_efficiency, check_replication
from dslc.check.batch import check_batch
from dslc.check.schedule import check_executor, check_pipelined_kernels, check_schedule
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


RUN_PASSES: tuple[Callable[[Program, Diagnostics], None], ...] = (check_executor,)


def check_program(program: Program, diags: Diagnostics, running: bool = True) -> None:
    """Every pass; `running` false leaves out `RUN_PASSES`."""
    for run in (*PASSES, *RUN_PASSES) if running else PASSES:
        run(program, diags)
