"""docs/plan.md's account of what a pipeline runs again agrees with the planner: the schedules
it names as adding `pipeline_recompute` FLOPs, and recompute-phase collectives, are exactly
those for which the planner counts them."""

from __future__ import annotations

import re

import pytest

import dslc
from dslc.plan import plan
from dslc.schedules import KINDS
from tests.conftest import ROOT, SPECS

DOC = ROOT / "docs" / "plan.md"
# gpt_small without its checkpointing, so that any recompute is the pipeline's own; tensor
# parallel, so that its layers have collectives to send again.
SPEC = (SPECS / "gpt_small.par").read_text().replace(" checkpoint selective(attn)", "")


def _section(doc: str, title: str) -> str:
    start = doc.index(f"\n## {title}\n")
    end = doc.find("\n## ", start + 1)
    return doc[start : end if end >= 0 else len(doc)]


def _schedules_named(passage: str) -> set[str]:
    return {kind for kind in re.findall(r"`([a-z0-9-]+)`", passage) if kind in KINDS}


def _planned(kind: str) -> tuple[int, int]:
    """`pipeline_recompute` FLOPs and recompute-phase bytes of the spec under `kind`."""
    text = SPEC if kind != "interleaved-1f1b" else SPEC.replace("schedule 1f1b", "schedule 1f1b\n  virtual 2")
    analysis = dslc.analyze(text, schedule=kind)
    assert analysis.ok and analysis.program is not None, [d.message for d in analysis.diagnostics]
    p = plan(analysis.program)
    return p.flops.pipeline_recompute, sum(t.bytes for t in p.communication if t.phase == "recompute")


@pytest.fixture(scope="module")
def planned() -> dict[str, tuple[int, int]]:
    return {kind: _planned(kind) for kind in KINDS}


def test_the_flops_section_names_the_schedules_whose_pipeline_reruns_work(
    planned: dict[str, tuple[int, int]],
) -> None:
    flops = _section(DOC.read_text(encoding="utf-8"), "FLOPs")
    (defined,) = [p for p in flops.split("\n\n") if "`pipeline_recompute`" in p]
    assert _schedules_named(defined) == {kind for kind, (extra, _) in planned.items() if extra}


def test_the_communication_rules_name_the_schedules_that_send_again(
    planned: dict[str, tuple[int, int]],
) -> None:
    rules = _section(DOC.read_text(encoding="utf-8"), "Communication: the rules")
    (recompute,) = re.findall(r"^- \*\*recompute\*\*:.*?(?=^- \*\*)", rules, re.M | re.S)
    assert _schedules_named(recompute) == {kind for kind, (_, sent) in planned.items() if sent}
