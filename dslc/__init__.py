"""dslc: a compiler for model-parallel training plans written in .par files.

`import dslc` and the front end (`check`, `analyze`) never import jax; `compile` does, on
first use.
"""

from typing import Any

from dslc.diagnostics import Diagnostic, Severity, Span
from dslc.frontend import CompileError, analyze, check

__all__ = ["CompileError", "Diagnostic", "Program", "Severity", "Span", "analyze", "check", "compile"]


def __getattr__(name: str) -> Any:
    if name == "compile":
        from dslc.lower import compile

        return compile
    if name == "Program":
        from dslc.lower.program import Program

        return Program
    raise AttributeError(f"module 'dslc' has no attribute {name!r}")
