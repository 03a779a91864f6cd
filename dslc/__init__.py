"""dslc: a compiler for model-parallel training plans written in .par files."""

from dslc.diagnostics import Diagnostic, Severity, Span
from dslc.frontend import analyze, check

__all__ = ["Diagnostic", "Severity", "Span", "analyze", "check"]
