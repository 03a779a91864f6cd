"""Where the runtime's names are defined, for the imports of generated modules.

A generated module imports what it calls from the runtime library (`dslc.runtime`, which it
imports as `dslc_runtime`) rather than holding a copy: the runtime's modules are read as text
(no jax) for the names each defines at top level.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from dslc.runtime import NAME, SOURCES

# The package generated modules import the runtime from.
RUNTIME = NAME

# The imports a runtime module may use besides its sibling modules: each is available to
# every generated module (a test holds `dslc.runtime` to this list). Name bound -> the import
# statement that binds it.
PRELUDE_IMPORTS = {
    "argparse": "import argparse",
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
    "Mesh": "from jax.sharding import Mesh",
    "NamedSharding": "from jax.sharding import NamedSharding",
    "Any": "from typing import Any",
    "Literal": "from typing import Literal",
    "NamedTuple": "from typing import NamedTuple",
    "Callable": "from collections.abc import Callable",
    "Sequence": "from collections.abc import Sequence",
    "Mapping": "from collections.abc import Mapping",
}


@dataclass(frozen=True, slots=True)
class Definition:
    name: str
    module: str  # the runtime module that defines it (`layers`)


@functools.cache
def definitions(module: Path) -> dict[str, Definition]:
    """Every top-level function, class and constant of a runtime module."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    found: dict[str, Definition] = {}
    for node in tree.body:
        match node:
            case ast.FunctionDef(name=name) | ast.ClassDef(name=name):
                names = [name]
            case ast.Assign(targets=targets):
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            case ast.AnnAssign(target=ast.Name(id=name)):
                names = [name]
            case _:
                continue
        for name in names:
            found[name] = Definition(name, module.stem)
    return found


def imported_names(module: Path) -> set[str]:
    """The names a module's imports bind."""
    names = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names - {"annotations"}


def all_definitions() -> dict[str, Definition]:
    """Every runtime module's public definitions (a name defined in two modules is the
    later's: none is)."""
    found: dict[str, Definition] = {}
    for module in SOURCES.values():
        found.update({n: d for n, d in definitions(module).items() if not n.startswith("_")})
    return found


def runtime_files() -> dict[str, str]:
    """The runtime library as `dslc compile` writes it beside a module: file name -> text."""
    init = Path(SOURCES["storage"]).with_name("__init__.py")
    return {path.name: path.read_text(encoding="utf-8") for path in [init, *SOURCES.values()]}
