"""Python names for things the spec named, and text from the spec made safe for comments.

Everything the user wrote reaches generated code through one of three doors, all here:
an identifier (a class or attribute name, checked and de-clashed), a string literal
(`repr`, always inert), or a comment (one line, printable characters only). Nothing else
from the spec is ever pasted into the output.
"""

from __future__ import annotations

import builtins
import keyword
import re

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
# Attributes every generated module has, and those NNX modules already define.
_MODULE_ATTRIBUTES = frozenset(
    {"path", "forward", "eval", "train", "sow", "perturb", "iter_children", "iter_modules", "set_attributes"}
)


class Namer:
    """Hands out unique, valid, non-clashing Python names in one namespace."""

    def __init__(self, reserved: set[str] | frozenset[str] = frozenset()) -> None:
        self.taken = set(reserved)

    def claim(self, wanted: str) -> str:
        name = safe_identifier(wanted)
        while name in self.taken or keyword.iskeyword(name) or keyword.issoftkeyword(name):
            name += "_"
        self.taken.add(name)
        return name


def safe_identifier(text: str) -> str:
    """`text` as a Python identifier: other characters become `_`, never a leading `_`
    (that would mean private, or worse, dunder)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", text).lstrip("_")
    if not name or not _IDENTIFIER.match(name):
        name = "n_" + name
    return name


def attribute_namer() -> Namer:
    return Namer(_MODULE_ATTRIBUTES)


def class_name(text: str) -> str:
    """`gpt_block` -> `GptBlock`."""
    return "".join(part[:1].upper() + part[1:] for part in safe_identifier(text).split("_") if part) or "Block"


def global_namer(module_globals: set[str]) -> Namer:
    """Names at module level must not shadow what the module itself defines or imports, nor builtins."""
    return Namer(module_globals | set(dir(builtins)))


def comment(text: str, width: int) -> str:
    """One line of spec text for a `#` comment: whitespace runs collapsed, anything not a
    printable ASCII character escaped, cut to `width` characters."""
    line = " ".join(text.split())
    line = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in line)
    return line if len(line) <= width else line[: max(width - 3, 0)] + "..."
