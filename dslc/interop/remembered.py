"""What `dslc import` remembers of a checkpoint's config.json, for `dslc export` to write back.

A config.json says more than a spec determines: the token ids (`bos_token_id`,
`eos_token_id`, `pad_token_id`), the longest sequence the model was trained for
(`max_position_embeddings`, where the spec's sequence is often shorter), dropout rates, the
model's name. Without them an exported checkpoint generates without ever stopping and
claims a shorter context than it has. So import keeps the config it read, whole, and export
writes its fields again, except those the spec determines, which come from the spec
(`FamilyBase.keep` says which).

It is kept in the weights .npz itself, as the zip archive's comment, in the same atomic
write as the weights:

- not as an entry of the archive: every reader of a weights .npz (`dslc run`, `dslc train
  --init-from`, `dslc export`, `Program.import_weights`, a compiled module's
  `import_weights`, anyone's `np.load`) takes each entry for a weight and refuses one the
  spec does not have. A comment is no entry: numpy never shows it, so the file stays exactly
  the spec's weights to every reader, unchanged.
- not in a file beside it: that could be left behind or go stale. Weights written over by
  `dslc init` or `numpy.savez` lose the comment with the old archive, instead of inheriting
  another checkpoint's token ids; copied, the weights take it along.

A zip comment holds at most 65,535 bytes. The config is stored as compact JSON after the
line MARK; one too long for that (no config of the families dslc maps comes near it) is
not kept, and its weights export as weights from `dslc init` do. A `dslc train` run does not
carry it into its checkpoints: `dslc export --weights RUN` writes the spec's config alone.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from pathlib import Path

from dslc.interop.errors import file_problem

MARK = b"dslc import: config.json\n"
# The most a zip archive's comment holds (its length is a 16-bit field).
LIMIT = 0xFFFF


def comment_for(config: Mapping[str, object]) -> bytes:
    """The archive comment that keeps `config`; empty when it does not fit in one."""
    text = MARK + json.dumps(config, separators=(",", ":")).encode("ascii")
    return text if len(text) <= LIMIT else b""


def recall(weights: Path) -> dict[str, object] | None:
    """The config.json kept in the weights .npz at `weights`; None when it keeps none (it was
    not written by `dslc import`, or is not a readable archive, which the weights' reader
    reports). A kept config that is not a JSON object is a CheckpointError (C007)."""
    try:
        with zipfile.ZipFile(weights) as archive:
            comment = archive.comment
    except (OSError, zipfile.BadZipFile):
        return None
    if not comment.startswith(MARK):
        return None
    try:
        config = json.loads(comment[len(MARK) :].decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        config = exc
    if not isinstance(config, dict):
        reason = f"not JSON ({config})" if isinstance(config, Exception) else "not a JSON object"
        raise file_problem(
            weights,
            "C007",
            f"the config.json these weights were imported with, kept in the archive's comment, is {reason}",
            help="import the checkpoint again, or save the weights anew (numpy.savez) to export without it",
        )
    return config
