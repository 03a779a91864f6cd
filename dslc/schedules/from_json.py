"""A schedule table from a file: the JSON `dslc schedule --format json` prints, read back.

Users write their own schedules this way: print a built-in one, edit it (or generate one), and
name the file in a spec (`schedule file "t.json"`) or with `--schedule t.json`. The table is
read with plain checks rather than a validation library: its shape is small (a few integers
and rows of four-field actions), this package imports only the standard library so that
`dslc check` and `dslc schedule` stay fast, and what matters is `validate`'s rules, which no
schema states. Every problem comes back as one `TableError`, naming the place in the JSON or,
once the shape is right, the stage, tick and action the validator objects to.

Keys: `stages`, `microbatches` and `actions` are required; `kind` (a label, default "file"),
`virtual` (chunks per stage, default the placement's or 1), `placement` (the stage of each
chunk, default chunk c on stage c % stages) and `ticks` (default one past the last action)
are optional; `bubble_fraction` and `peak_in_flight` are what `dslc schedule` printed and are
recomputed, not read.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path

from dslc.schedules.table import MAX_ACTIONS, Action, Op, Schedule, ring_placement
from dslc.schedules.validate import validate

# A table of `MAX_ACTIONS` actions, as `dslc schedule` indents it, is about 25 MiB.
MAX_FILE_BYTES = 32 * 1024 * 1024
_KEYS = (
    "kind",
    "stages",
    "microbatches",
    "virtual",
    "placement",
    "ticks",
    "bubble_fraction",
    "peak_in_flight",
    "actions",
)
_ACTION_KEYS = ("tick", "op", "microbatch", "chunk")
# How many more of the validator's problems an error lists before counting the rest.
SHOWN_PROBLEMS = 8


class TableError(ValueError):
    """A schedule file that cannot be used: `message` says why; when the file reads but the
    table cannot run, it names the first broken rule (stage, tick and action) and `problems`
    the next few."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.problems = tuple(problems)


def read_table(path: str | os.PathLike[str]) -> Schedule:
    """The valid table in the JSON file at `path`, of at most `MAX_ACTIONS` actions."""
    name = str(path)
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise TableError(f"cannot read the schedule file `{name}`: {exc.strerror or exc}") from None
    return _read(name, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read(name: str, modified: int, size: int) -> Schedule:
    """The table at `name`, read once per version of the file (a search elaborates a spec many times)."""
    del modified  # part of the cache key only: an edited file is read again
    if size > MAX_FILE_BYTES:
        raise TableError(f"the schedule file `{name}` is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB")
    try:
        text = Path(name).read_bytes().decode("utf-8")
    except OSError as exc:
        raise TableError(f"cannot read the schedule file `{name}`: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TableError(f"the schedule file `{name}` is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise TableError(f"the schedule file `{name}` is not JSON{where}: {exc}") from None
    return table_from_json(data, f"the schedule table in `{name}`")


def table_from_json(data: object, name: str = "the schedule table") -> Schedule:
    """The valid table `data` describes (JSON as `to_json` writes it), or `TableError`."""
    if not isinstance(data, dict):
        raise TableError(f"{name} must be a JSON object with `stages`, `microbatches` and `actions`")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise TableError(f"{name} has unknown keys {', '.join(map(repr, unknown))}; the keys are {', '.join(_KEYS)}")
    kind = data.get("kind", "file")
    if not isinstance(kind, str) or not kind:
        raise TableError(f"{name}: `kind` must be a label (a non-empty string), got {kind!r}")
    stages = _count(data, "stages", name)
    microbatches = _count(data, "microbatches", name)
    rows = data.get("actions")
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise TableError(f"{name}: `actions` must be a list of one list of actions per stage")
    total = sum(len(row) for row in rows)
    if total > MAX_ACTIONS:
        raise TableError(f"{name} has {total:,} actions, more than the {MAX_ACTIONS:,} dslc reads")
    placement = _placement(data, name)
    virtual = _count(data, "virtual", name) if "virtual" in data else max(1, len(placement) // stages)
    if "placement" not in data:
        placement = ring_placement(stages, virtual)
    actions = tuple(
        tuple(_action(entry, f"actions[{s}][{i}]", s, name) for i, entry in enumerate(row))
        for s, row in enumerate(rows)
    )
    last = max((a.tick for row in actions for a in row), default=-1)
    ticks = _count(data, "ticks", name) if "ticks" in data else last + 1
    schedule = Schedule(kind, stages, microbatches, virtual, ticks, actions, placement)
    problems = validate(schedule)
    if problems:
        first, *rest = problems
        more = [f"... and {len(rest) - SHOWN_PROBLEMS} more"] if len(rest) > SHOWN_PROBLEMS else []
        raise TableError(f"{name} cannot run: {first}", rest[:SHOWN_PROBLEMS] + more)
    return schedule


def _count(data: dict[str, object], key: str, name: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        missing = "is missing" if key not in data else f"must be a whole number of at least 1, got {value!r}"
        raise TableError(f"{name}: `{key}` {missing}")
    return value


def _placement(data: dict[str, object], name: str) -> tuple[int, ...]:
    if "placement" not in data:
        return ()
    value = data["placement"]
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise TableError(f"{name}: `placement` must list the stage of each chunk, got {value!r}")
    return tuple(value)


def _action(entry: object, where: str, stage: int, name: str) -> Action:
    if not isinstance(entry, dict) or set(entry) != set(_ACTION_KEYS):
        raise TableError(f"{name}: {where} must be an object with exactly {', '.join(_ACTION_KEYS)}, got {entry!r}")
    for key in ("tick", "microbatch", "chunk"):
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TableError(f"{name}: {where}.{key} must be a whole number, got {value!r}")
    ops = [op.value for op in Op]
    if entry["op"] not in ops:
        raise TableError(f"{name}: {where}.op must be one of {', '.join(ops)}, got {entry['op']!r}")
    return Action(entry["tick"], stage, Op(entry["op"]), entry["microbatch"], entry["chunk"])
