"""Tables read back from the JSON `dslc schedule --format json` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslc.schedules import KINDS, MAX_ACTIONS, build, to_json
from dslc.schedules.from_json import SHOWN_PROBLEMS, TableError, read_table, table_from_json


def printed(kind: str, stages: int, microbatches: int) -> dict[str, object]:
    """The JSON text `dslc schedule` prints, parsed as a reader parses it."""
    virtual = 2 if kind == "interleaved-1f1b" else None
    data = json.loads(json.dumps(to_json(build(kind, stages, microbatches, virtual)), indent=2))
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_back_as_the_table_it_was(kind: str, tmp_path: Path) -> None:
    for stages, microbatches in ((1, 2), (3, 6), (4, 8)):
        path = tmp_path / f"{kind}-{stages}-{microbatches}.json"
        path.write_text(json.dumps(printed(kind, stages, microbatches), indent=2))
        virtual = 2 if kind == "interleaved-1f1b" else None
        assert read_table(path) == build(kind, stages, microbatches, virtual)


def test_the_printed_figures_are_recomputed_not_read() -> None:
    data = printed("1f1b", 2, 4)
    data["bubble_fraction"], data["peak_in_flight"] = 0.0, [0, 0]
    table = table_from_json(data)
    assert table.bubble_fraction == build("1f1b", 2, 4).bubble_fraction == 0.2


def test_optional_keys_take_their_defaults() -> None:
    """Without `kind`, `virtual`, `placement` and `ticks`: label `file`, one chunk per stage
    (chunk c on stage c % P), and one tick past the last action."""
    data = printed("gpipe", 3, 3)
    for key in ("kind", "virtual", "placement", "ticks", "bubble_fraction", "peak_in_flight"):
        del data[key]
    table = table_from_json(data)
    assert (table.kind, table.virtual, table.placement, table.ticks) == (
        "file",
        1,
        (0, 1, 2),
        build("gpipe", 3, 3).ticks,
    )


def test_an_edited_table_keeps_its_own_timing() -> None:
    """A user's order: stage 1 runs its two forwards before its first backward (GPipe-like on
    the last stage); the table says so and its bubble follows."""
    data = printed("1f1b", 2, 2)
    data["kind"] = "mine"
    # 1f1b on 2 stages, 2 microbatches: stage 1 runs F0 B0 F1 B1 at ticks 1..4; make it F0 F1 B0 B1.
    data["actions"][1] = [  # type: ignore[index]
        {"tick": 1, "op": "F", "microbatch": 0, "chunk": 1},
        {"tick": 2, "op": "F", "microbatch": 1, "chunk": 1},
        {"tick": 3, "op": "B", "microbatch": 0, "chunk": 1},
        {"tick": 4, "op": "B", "microbatch": 1, "chunk": 1},
    ]
    data["actions"][0][2]["tick"] = 4  # type: ignore[index]  # stage 0's B0 waits for it
    data["actions"][0][3]["tick"] = 5  # type: ignore[index]
    table = table_from_json(data)
    assert table.kind == "mine"
    assert table.ticks == 6
    assert table.peak_in_flight == (2, 2)


def test_problems_past_the_first_few_are_counted() -> None:
    data = printed("1f1b", 4, 8)
    data["actions"] = [row[:1] for row in data["actions"]]  # type: ignore[attr-defined]
    with pytest.raises(TableError) as caught:
        table_from_json(data)
    problems = caught.value.problems
    assert len(problems) == SHOWN_PROBLEMS + 1
    assert problems[-1].startswith("... and ") and problems[-1].endswith(" more")


def test_a_table_past_the_limit_is_refused_before_it_is_read_in_full() -> None:
    data = {"stages": 1, "microbatches": 1, "actions": [[{}] * (MAX_ACTIONS + 1)]}
    with pytest.raises(TableError, match="has 262,145 actions, more than the 262,144 dslc reads"):
        table_from_json(data)


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(printed("1f1b", 2, 2)))
    assert read_table(path).microbatches == 2
    path.write_text(json.dumps(printed("1f1b", 2, 4), indent=1))
    assert read_table(path).microbatches == 4


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff", "is not UTF-8 text"),
        (b'{"stages": 1, "microbatches": 1, "actions": [[]], "kind": ""}', "`kind` must be a label"),
        (b'{"stages": 1, "microbatches": 1, "actions": [{}]}', "`actions` must be a list of one list"),
        (b'{"stages": 1, "microbatches": 1, "actions": [[{"tick": 0}]]}', "must be an object with exactly tick"),
        (b'{"stages": 1, "microbatches": 1, "placement": [true], "actions": [[]]}', "`placement` must list"),
        (b'{"stages": true, "microbatches": 1, "actions": [[]]}', "`stages` must be a whole number"),
    ],
)
def test_malformed_files_say_what_is_wrong(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(data)
    with pytest.raises(TableError, match=message):
        read_table(path)
