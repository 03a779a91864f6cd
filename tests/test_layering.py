"""dslc's packages in layers, read off every module's imports without importing anything: no
two of them import each other, and the planner reads only the IR, the layer rules and the
schedules (the `--mesh auto` search, `dslc.search`, runs it with the elaborator and the
checker, from above)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from tests.conftest import ROOT

PACKAGE = ROOT / "dslc"


def imports_between_packages() -> dict[str, set[str]]:
    """For each top-level package or module of dslc (`plan`, `check`, `cli`, ...), the others
    its modules import."""
    found: dict[str, set[str]] = defaultdict(set)
    for module in PACKAGE.rglob("*.py"):
        own = module.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"), str(module))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                parts = name.split(".")
                if parts[0] == "dslc" and len(parts) > 1 and parts[1] != own:
                    found[own].add(parts[1])
    return found


def test_no_two_packages_import_each_other() -> None:
    edges = imports_between_packages()
    assert {"plan", "check", "search"} <= set(edges)  # the walk saw the packages
    both_ways = sorted(
        {tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in edges.get(b, set())}
    )
    assert both_ways == []


def test_the_planner_imports_nothing_above_the_ir() -> None:
    assert imports_between_packages().get("plan", set()) <= {"ir", "layers", "schedules", "diagnostics"}


def test_only_the_layer_rules_read_a_layer_argument_by_name() -> None:
    """Outside dslc/layers a layer's arguments are read typed (`args(attn, Attention).heads`):
    a renamed or retyped argument is then a type error, not a silently missing key."""
    by_name = re.compile(r"\.attr\(|\battrs\)\[")
    found = [
        f"{module.relative_to(PACKAGE)}:{number}"
        for module in PACKAGE.rglob("*.py")
        if module.relative_to(PACKAGE).parts[0] not in ("layers", "ir")
        for number, line in enumerate(module.read_text(encoding="utf-8").splitlines(), 1)
        if by_name.search(line)
    ]
    assert not found, found


def test_each_layer_argument_is_declared_once() -> None:
    """A layer kind's arguments are the fields of its `Args`, each declared with `arg`: no
    rule lists them a second time, and no two kinds share one `Args` (whose fields would then
    be the arguments of neither)."""
    from dataclasses import fields

    from dslc.layers import RULES

    listed = [
        f"{module.name}:{number}"
        for module in (PACKAGE / "layers").glob("*.py")
        for number, line in enumerate(module.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s+args\s*=", line)
    ]
    assert not listed, listed
    seen: dict[type, str] = {}
    for kind, rule in RULES.items():
        declared = [f.name for f in fields(rule.Args)]
        assert [a.name for a in rule.args] == [name.removesuffix("_") for name in declared], kind
        if declared:
            assert rule.Args not in seen, f"`{kind}` shares its arguments with `{seen.get(rule.Args)}`"
            seen[rule.Args] = kind
