"""The kernels' source, for copying into generated modules.

The generated module runs the same functions the direct backend calls (`dslc.kernels`),
copied verbatim, so that the two backends compute with the same code. Only the functions a
program uses are copied, with the module-level functions and constants they refer to.
"""

from __future__ import annotations

import ast
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

from dslc.kernels import SOURCES

# The imports a kernel module may use: each is available in every generated module (a test
# holds `dslc.kernels` to this list). Name bound -> the import statement that binds it.
PRELUDE_IMPORTS = {
    "functools": "import functools",
    "itertools": "import itertools",
    "math": "import math",
    "re": "import re",
    "zlib": "import zlib",
    "np": "import numpy as np",
    "jax": "import jax",
    "jnp": "import jax.numpy as jnp",
    "optax": "import optax",
    "nnx": "from flax import nnx",
    "lax": "from jax import lax",
    "checkpoint_name": "from jax.ad_checkpoint import checkpoint_name",
    "PartitionSpec": "from jax.sharding import PartitionSpec",
    "Any": "from typing import Any",
    "NamedTuple": "from typing import NamedTuple",
    "Callable": "from collections.abc import Callable",
    "Sequence": "from collections.abc import Sequence",
}


@dataclass(frozen=True, slots=True)
class Definition:
    name: str
    source: str
    uses: frozenset[str]  # module-level names it refers to
    module: str  # the kernel module it comes from (`layers`)
    lines: tuple[int, int]  # where its source is in the module: first and last line
    blank_before: int  # the blank lines right above it there
    statement: bool  # an assignment, not a function or a class


@functools.cache
def definitions(module: Path) -> dict[str, Definition]:
    """Every top-level function and constant assignment of a kernel module, in file order."""
    text = module.read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines()
    found: dict[str, Definition] = {}
    for node in tree.body:
        match node:
            case ast.FunctionDef(name=name) | ast.ClassDef(name=name):
                names, statement = [name], False
            case ast.Assign(targets=targets):
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                statement = True
            case ast.AnnAssign(target=ast.Name(id=name)):
                names, statement = [name], True
            case _:
                continue
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        # Comments directly above a definition belong to it.
        while start > 1 and lines[start - 2].lstrip().startswith("#"):
            start -= 1
        end = node.end_lineno or node.lineno
        blank = 0
        while start - blank > 1 and not lines[start - blank - 2].strip():
            blank += 1
        source = "\n".join(lines[start - 1 : end])
        uses = frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
        for name in names:
            found[name] = Definition(name, source, uses, module.stem, (start, end), blank, statement)
    return found


def joined(definitions: list[Definition]) -> str:
    """The definitions' source, one after another as a module lays them out: two blank lines
    around a function or a class; between assignments that follow each other in their kernel
    module, the blank lines they have there (constants that belong together stay together)."""
    parts = [d.source for d in definitions[:1]]
    for previous, d in itertools.pairwise(definitions):
        between = d.lines[0] - previous.lines[1] - 1  # nothing but blank lines, when adjacent
        together = previous.statement and d.statement and previous.module == d.module and between == d.blank_before
        parts.append("\n" * (1 + (between if together else 2)) + d.source)
    return "".join(parts)


def imported_names(module: Path) -> set[str]:
    """The names a module's imports bind."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names - {"annotations"}


def all_definitions() -> dict[str, Definition]:
    """Every kernel module's definitions, module after module in `SOURCES` order (a kernel
    module may use another's: the copies land in one generated module)."""
    found: dict[str, Definition] = {}
    for module in SOURCES.values():
        found.update(definitions(module))
    return found


def closure(wanted: list[str]) -> list[Definition]:
    """The definitions `wanted` needs, dependencies included, in the kernels' own order."""
    defs = all_definitions()
    needed: set[str] = set()
    stack = list(wanted)
    while stack:
        name = stack.pop()
        if name in needed or name not in defs:
            continue
        needed.add(name)
        stack.extend(defs[name].uses)
    seen: set[str] = set()
    ordered = []
    for d in defs.values():
        if d.name in needed and d.source not in seen:
            seen.add(d.source)
            ordered.append(d)
    return ordered


def names_used(definitions: list[Definition]) -> set[str]:
    return set().union(*(d.uses for d in definitions)) if definitions else set()
