"""Import a Hugging Face checkpoint into a spec's weights, and export them back.

Import checks, in order, before it writes anything: the config against the spec (nothing of
the tensors read yet), then every tensor file's header (names, shapes, dtypes, layouts); only
then does it read the tensors, one at a time, each converted and written before the next is
read. Export checks the spec and the weights, then writes config.json and one
model.safetensors, each file atomically.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import ml_dtypes
import numpy as np

from dslc.diagnostics import Diagnostic, error, sort_key
from dslc.files import write_atomic
from dslc.frontend import Analysis
from dslc.interop.advice import follows
from dslc.interop.errors import CheckpointError, file_problem, file_span
from dslc.interop.gemma2 import Gemma2
from dslc.interop.gpt2 import GPT2
from dslc.interop.gpt_neox import GPTNeoX
from dslc.interop.hf_config import CONFIG, AnyConfig, parse_config, read_config_json
from dslc.interop.llama import Llama, Mixtral, Qwen2Moe, Qwen3Moe
from dslc.interop.mapping import (
    Fact,
    Matched,
    Requirement,
    Structure,
    TensorMap,
    disagreeing,
    disagreements,
    unmet,
    unsupported,
)
from dslc.interop.remembered import comment_for, recall
from dslc.interop.safetensors_io import FLOAT_DTYPES, INDEX, SINGLE, TensorFiles, npz_writer, write_safetensors
from dslc.interop.t5 import T5
from dslc.interop.vit import ViT
from dslc.ir import nodes as ir
from dslc.ir.weights import mismatches


class Family(Protocol):
    """How one family of checkpoints maps onto a spec (see gpt2.py, llama.py, gpt_neox.py, gemma2.py, vit.py,
    t5.py)."""

    name: str
    model_types: tuple[str, ...]
    structure: Structure
    head_tensor: str

    def match(self, program: ir.Program) -> Matched: ...
    def canonical(self, name: str) -> str: ...
    def ignored(self, name: str) -> bool: ...
    def copies(self, name: str) -> tuple[str, ...]: ...
    def requirements(self, m: Matched) -> list[Requirement]: ...
    def unmapped_attention(self, m: Matched) -> list[Requirement]: ...
    def facts(self, config: AnyConfig, m: Matched, program: ir.Program) -> list[Fact]: ...
    def unsupported(self, config: AnyConfig, program: ir.Program) -> list[tuple[str, str]]: ...
    def ties(self, m: Matched) -> bool: ...
    def tied(self, m: Matched, program: ir.Program) -> bool: ...
    def head_and_table(self, m: Matched) -> tuple[str, str]: ...
    def tensors(self, m: Matched, tied: bool) -> list[TensorMap]: ...
    def config(self, m: Matched, program: ir.Program, tied: bool, dtype: str) -> dict[str, object]: ...
    def keep(self, written: Mapping[str, object], original: Mapping[str, object]) -> dict[str, object]: ...


FAMILIES: tuple[Family, ...] = (GPT2(), Llama(), Mixtral(), Qwen3Moe(), Qwen2Moe(), GPTNeoX(), Gemma2(), ViT(), T5())

# The dtypes export writes: the spec's names, numpy's, and the torch_dtype config.json states.
EXPORT_DTYPES = {
    "f32": (np.dtype(np.float32), "float32"),
    "bf16": (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    "f16": (np.dtype(np.float16), "float16"),
}


def _program(analysis: Analysis) -> ir.Program:
    assert analysis.ok and analysis.program is not None, "import and export take a spec that checked clean"
    return analysis.program


def _family_of(model_type: str) -> Family:
    return next(f for f in FAMILIES if model_type in f.model_types)


def _requirements(family: Family, m: Matched) -> list[Requirement]:
    """What the spec must be to be built like the family: its own requirements, and no
    attention argument it does not map."""
    return family.requirements(m) + family.unmapped_attention(m)


def _raise_if(diagnostics: list[Diagnostic]) -> None:
    if diagnostics:
        raise CheckpointError(sorted(diagnostics, key=sort_key))


# ---- import --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportPlan:
    """A checkpoint that fits the spec, checked down to every tensor's header."""

    family: Family
    model_type: str
    files: TensorFiles
    maps: list[TensorMap]
    found: dict[str, str]  # each mapped tensor's name as save_pretrained writes it -> in the files
    shapes: dict[str, tuple[int, ...]]  # the spec's weights
    table: str | None  # a tied checkpoint's: the embedding's table, which its head is
    copy: str | None  # a spec's head that holds a copy of the tied table (transposed), not the table itself
    stored_head: str | None  # a tied checkpoint's head, where it is stored anyway: it must be the table
    dtype: np.dtype
    config: Mapping[str, object]  # config.json as the folder holds it, every field
    # A mapped tensor's other names in the files, each the same tensor (T5's
    # `encoder.embed_tokens.weight`, which is its `shared.weight`): compared with it as it is read.
    copies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every weight of the spec by its dotted name, read one checkpoint tensor at a time
        (a stacked weight's slices, which a family lists in order, one weight at a time)."""
        stacking: dict[str, list[np.ndarray]] = {}
        for m in self.maps:
            tensor = self.files.read(self.found[m.name])
            if m.parts == (self.table,):
                self._same_head(tensor, m.name)
            self._same_copies(tensor, m.name)
            if tensor.dtype != self.dtype:
                tensor = tensor.astype(self.dtype)
            tensor = m.to_spec(tensor)
            if m.index is not None:
                # One slice of a stacked weight: the weight is whole once its last slice is read.
                (part,) = m.parts
                slices = stacking.setdefault(part, [])
                slices.append(tensor)
                if len(slices) == self.shapes[part][0]:
                    yield part, np.stack(stacking.pop(part))
                continue
            yield from zip(m.parts, m.split(tensor, [self.shapes[p][-1] for p in m.parts]), strict=True)
            if self.copy is not None and m.parts == (self.table,):
                yield self.copy, tensor.T

    def _same_copies(self, tensor: np.ndarray, name: str) -> None:
        """Each other name the files store tensor `name` under must hold the same tensor."""
        for copy in self.copies.get(name, ()):
            if not np.array_equal(self.files.read(copy), tensor):
                raise CheckpointError(
                    [
                        error(
                            "C006",
                            f"`{copy}` differs from `{self.found[name]}`: transformers ties them, one tensor "
                            "under both names",
                            file_span(self.files.tensors[copy].file),
                            help="save the checkpoint again with transformers' own save_pretrained",
                        )
                    ]
                )

    def _same_head(self, table: np.ndarray, name: str) -> None:
        """A tied checkpoint that stores its head too: the head must be the table (`name`)."""
        if self.stored_head is None:
            return
        head = self.files.read(self.stored_head)
        if not np.array_equal(head, table):
            raise CheckpointError(
                [
                    error(
                        "C006",
                        f"`{self.stored_head}` differs from the embedding `{self.found[name]}`, "
                        "but config.json ties them (tie_word_embeddings)",
                        file_span(self.files.tensors[self.stored_head].file),
                        help="set tie_word_embeddings false in config.json and import into a spec whose head "
                        "is its own weight, or save the checkpoint again",
                    )
                ]
            )


@dataclass(frozen=True)
class Imported:
    family: str
    model_type: str
    weights: int
    parameters: int
    tensors: int


def plan_import(analysis: Analysis, folder: Path) -> ImportPlan:
    """Check the checkpoint in `folder` against the spec, reading no tensor's values; a
    CheckpointError says every way in which it does not fit."""
    program = _program(analysis)
    config_path = folder / CONFIG
    config_json = read_config_json(folder)
    config = parse_config(config_json, config_path)
    assert isinstance(config_json, dict)  # parse_config takes nothing else
    family = _family_of(config.model_type)
    matched = family.match(program)
    disagree = disagreeing(family.facts(config, matched, program), analysis)

    def facts_of(other: ir.Program) -> list[Fact]:
        return family.facts(config, family.match(other), other)

    _raise_if(
        unmet(_requirements(family, matched), family.name)
        + disagreements(disagree, analysis, config_path, follows(disagree, analysis, facts_of) if disagree else None)
        + unsupported(config_path, family.unsupported(config, program))
    )
    files = TensorFiles(folder)
    tied = family.tied(matched, program)
    maps = family.tensors(matched, tied)
    shapes = {name: w.shape for name, w in ir.weights_by_path(program).items()}
    head, table = family.head_and_table(matched)
    # A spec whose head is a weight of its own holds a copy of a tied checkpoint's table.
    copy = head if tied and not family.ties(matched) else None
    covered = {p for m in maps for p in m.parts} | ({copy} if copy else set())
    assert covered == set(shapes), f"the {family.name} mapping misses {sorted(set(shapes) ^ covered)}"
    found = _check_tensors(family, files, maps, shapes, tied)
    stored_as = {family.canonical(name): name for name in files.tensors}
    copies: dict[str, tuple[str, ...]] = {}
    for m in maps:
        others = tuple(stored_as[c] for c in family.copies(m.name) if c in stored_as and stored_as[c] != found[m.name])
        if others:
            copies[m.name] = others
    stored_head = (
        next((name for name in files.tensors if family.canonical(name) == family.head_tensor), None) if tied else None
    )
    dtype = np.dtype(np.float64) if program.train.param_dtype == "f64" else np.dtype(np.float32)
    return ImportPlan(
        family,
        config.model_type,
        files,
        maps,
        found,
        shapes,
        table if tied else None,
        copy,
        stored_head,
        dtype,
        config_json,
        copies,
    )


def import_checkpoint(analysis: Analysis, folder: Path, out: Path) -> Imported:
    """Write the checkpoint in `folder` as the spec's weights (.npz by dotted name) to `out`;
    nothing is written unless all of it fits. The archive keeps the checkpoint's config.json
    for `export_checkpoint` (see dslc/interop/remembered.py)."""
    plan = plan_import(analysis, folder)
    parameters = 0
    with npz_writer(out, comment_for(plan.config)) as npz:
        for name, array in plan.arrays():
            npz.add(name, array)
            parameters += array.size
    return Imported(plan.family.name, plan.model_type, len(npz.names), parameters, len(plan.maps))


def _check_tensors(
    family: Family, files: TensorFiles, maps: list[TensorMap], shapes: dict[str, tuple[int, ...]], tied: bool
) -> dict[str, str]:
    """Each mapped tensor's name in the files; C006 for what is missing, left over, of another
    shape or dtype, or stored the other way round."""
    found: dict[str, str] = {}
    problems: list[Diagnostic] = []
    for name in sorted(files.tensors):
        canonical = family.canonical(name)
        if canonical in found:
            problems.append(_tensor_error(files, name, f"`{name}` and `{found[canonical]}` are the same tensor"))
        found[canonical] = name
    wanted = {m.name for m in maps}
    # The mapped tensors, and the other names a family's checkpoints may store them under too.
    known = wanted | {c for m in maps for c in family.copies(m.name)}
    for m in maps:
        # A tensor stored only under another of its names is read from there.
        if m.name not in found:
            stored = next((c for c in family.copies(m.name) if c in found), None)
            if stored is not None:
                found[m.name] = found[stored]
    missing = [m.name for m in maps if m.name not in found]
    # A tied head is the embedding: transformers ties it again on loading whatever is stored.
    left_over = [
        name
        for canonical, name in found.items()
        if canonical not in known and not family.ignored(name) and not (tied and canonical == family.head_tensor)
    ]
    if missing:
        problems.append(
            error(
                "C006",
                f"{len(missing)} tensor{'s' * (len(missing) != 1)} of the spec missing: {_listed(missing)}",
                file_span(files.folder),
                notes=["the config ties the head to the embedding"] if tied else [],
            )
        )
    if left_over:
        problems.append(
            error(
                "C006",
                f"{len(left_over)} tensor{'s' * (len(left_over) != 1)} the spec has no place for: {_listed(left_over)}",
                file_span(files.folder),
            )
        )
    transposed: list[tuple[str, tuple[int, ...]]] = []
    square: list[str] = []
    for m in maps:
        if m.name not in found:
            continue
        info = files.tensors[found[m.name]]
        want = _checkpoint_shape(m, shapes)
        if info.dtype not in FLOAT_DTYPES:
            problems.append(_tensor_error(files, found[m.name], f"`{found[m.name]}` holds {info.dtype}, not floats"))
        elif info.shape == want:
            if m.kernel and want[0] == want[1]:
                square.append(found[m.name])
        elif len(want) == 2 and info.shape == want[::-1]:
            transposed.append((found[m.name], want))
        else:
            problems.append(
                _tensor_error(
                    files, found[m.name], f"`{found[m.name]}` is {list(info.shape)}, the spec needs {list(want)}"
                )
            )
    if transposed:
        problems.append(_transposed(files, family, transposed, square))
    _raise_if(problems)
    return {name: found[name] for name in wanted}


def _checkpoint_shape(m: TensorMap, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the checkpoint stores `m` in, from the spec's weights (whose parts take the
    same room side by side or interleaved by head)."""
    first = shapes[m.parts[0]]
    shape = (*first[:-1], sum(shapes[p][-1] for p in m.parts))
    if m.index is not None:
        shape = shape[1:]
    return m.stored_shape(shape)


def _transposed(
    files: TensorFiles, family: Family, transposed: list[tuple[str, tuple[int, ...]]], square: list[str]
) -> Diagnostic:
    name, want = transposed[0]
    notes = [f"{family.name} stores `{name}` as {list(want)}"]
    if square:
        notes.append(
            f"square matrices ({_listed(square)}) look the same either way round: their shape cannot tell, "
            "and this checkpoint's other matrices say they are turned too"
        )
    return error(
        "C006",
        f"{len(transposed)} matri{'ces' if len(transposed) > 1 else 'x'} stored the other way round "
        f"({_listed([n for n, _ in transposed])}): this is not the layout {family.name} checkpoints have",
        file_span(files.tensors[name].file),
        notes=notes,
        help="save the model with transformers' own save_pretrained, which writes the layout it loads",
    )


def _tensor_error(files: TensorFiles, name: str, message: str) -> Diagnostic:
    return error("C006", message, file_span(files.tensors[name].file))


def _listed(names: list[str], shown: int = 3) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"`{n}`" for n in names[:shown]) + more


# ---- export --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    family: str
    model_type: str
    tensors: int
    tied: bool
    bytes: int


def recognise(program: ir.Program) -> tuple[Family, Matched]:
    """The family the spec is built like: of those whose order of layers it follows, the
    first whose requirements it meets (Mixtral and Qwen3-MoE share an order; their attention
    tells them apart), else the first; a CheckpointError (C002, one per family) when none."""
    tried: list[Diagnostic] = []
    built: list[tuple[Family, Matched]] = []
    for family in FAMILIES:
        try:
            built.append((family, family.match(program)))
        except CheckpointError as exc:
            tried += exc.diagnostics
    if not built:
        raise CheckpointError(tried)
    return next(((f, m) for f, m in built if not unmet(_requirements(f, m), f.name)), built[0])


def export_checkpoint(
    analysis: Analysis,
    weights: Mapping[str, np.ndarray],
    folder: Path,
    *,
    untie: bool = False,
    dtype: str | None = None,
    source: Path | None = None,
    original: Mapping[str, object] | None = None,
) -> Exported:
    """Write `weights` (by dotted name, as `dslc init` or `dslc import` write them) as a
    Hugging Face checkpoint folder: config.json and model.safetensors, a tied head stored once.
    `source` is where the weights came from, named in the messages. `original` is the
    config.json they were imported from (`ImportPlan.config`); by default, the one a .npz
    `source` keeps. Its fields the spec does not determine are written again (token ids, a
    longer `max_position_embeddings`, ...), those it does come from the spec."""
    program = _program(analysis)
    family, matched = recognise(program)
    _raise_if(unmet(_requirements(family, matched), family.name))
    where = source or folder
    _check_weights(weights, program, where)
    if original is None and source is not None and source.is_file():
        original = recall(source)
    tied = family.tied(matched, program) and not untie
    head, table = family.head_and_table(matched)
    if tied and not family.ties(matched) and not np.array_equal(weights[head], weights[table].T):
        gap = float(np.max(np.abs(np.asarray(weights[head], np.float64) - np.asarray(weights[table], np.float64).T)))
        raise file_problem(
            where,
            "C007",
            f"the head `{head}` is no longer the embedding `{table}` it is tied to (largest difference {gap:.3g})",
            notes=[
                "the spec's head is a weight of its own, which training moves apart from the embedding: "
                "a tied checkpoint would drop it (a head written `tie kernel = TABLE.T` is the table itself)"
            ],
            help="export with --untie to write both (tie_word_embeddings false), or declare `const tied = false`",
        )
    np_dtype, torch_dtype = EXPORT_DTYPES[dtype or _spec_dtype(program)]
    maps = family.tensors(matched, tied)
    tensors = {m.name: _assemble(m, weights, np_dtype) for m in maps}
    config = family.config(matched, program, tied, torch_dtype)
    # Weights of another family's checkpoint cannot fit this spec: such a config is not theirs.
    if original is not None and original.get("model_type") in family.model_types:
        config = family.keep(config, original)
    _prepare(folder)
    write_safetensors(folder / SINGLE, tensors)
    write_atomic(folder / CONFIG, json.dumps(config, indent=2) + "\n")
    model_type = str(config["model_type"])
    return Exported(family.name, model_type, len(tensors), tied, sum(t.nbytes for t in tensors.values()))


def _spec_dtype(program: ir.Program) -> str:
    return program.train.param_dtype if program.train.param_dtype in EXPORT_DTYPES else "f32"


def _check_weights(weights: Mapping[str, np.ndarray], program: ir.Program, where: Path) -> None:
    problems = mismatches(program, {name: tuple(np.shape(value)) for name, value in weights.items()})
    if problems:
        raise file_problem(where, "C007", "the weights do not fit the spec", notes=problems)


def _assemble(m: TensorMap, weights: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
    parts = [np.asarray(weights[p]) for p in m.parts]
    if m.index is not None:
        parts = [parts[0][m.index]]
    tensor = m.join(parts)
    return np.ascontiguousarray(m.to_checkpoint(tensor).astype(dtype, copy=False))


def _prepare(folder: Path) -> None:
    """The output folder, made when missing; one that holds a sharded checkpoint is refused
    (its index would still name the old shards)."""
    if not folder.parent.is_dir():
        raise file_problem(folder, "C005", f"no such folder: {folder.parent}")
    folder.mkdir(exist_ok=True)
    stale = sorted(p.name for p in folder.glob("*.safetensors") if p.name != SINGLE)
    if (folder / INDEX).exists() or stale:
        raise file_problem(
            folder,
            "C005",
            "holds a sharded checkpoint, whose files would stay beside the exported one",
            notes=[f"found {', '.join([INDEX] * (folder / INDEX).exists() + stale)}"],
            help="export into an empty folder",
        )
