"""The code's shape, checked: no import cycle, no oversized module.

Imports are read from the source (AST), not from a running interpreter, so
every import statement counts: module level, inside functions, and under
`TYPE_CHECKING` (a cycle only type checkers see still ties the modules
together for a reader and for the next refactoring)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("service", "client")
MAX_LINES = 600
# A longer module is allowed when its docstring says it holds one algorithm.
ONE_ALGORITHM = "one algorithm"


def import_graph(*roots: tuple[Path, str]) -> dict[str, set[str]]:
    """Module -> the modules it imports, over the (folder, package) roots given."""
    modules: dict[str, tuple[Path, bool]] = {}
    for folder, package in roots:
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join([package, *parts])] = (path, is_package)

    def targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [
            f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
            for alias in node.names
        ]

    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets(module, is_package, node):
                    while target not in modules and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in modules and target != module:
                        edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("folder", ["service", "client"])
def test_no_import_cycle(folder: str) -> None:
    graph = import_graph((ROOT / folder, f"tierckpt.{folder}"))
    assert len(graph) > 5
    assert cycles(graph) == []


def test_no_import_cycle_across_service_and_client() -> None:
    # The CLI starts the service and the service may use client helpers:
    # read as one graph, the two packages must still have no cycle.
    graph = import_graph(*((ROOT / folder, f"tierckpt.{folder}") for folder in PACKAGES))
    assert any(t.startswith("tierckpt.service") for t in graph["tierckpt.client.cli"])
    assert cycles(graph) == []


def test_the_checker_sees_a_cycle_through_type_checking(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (tmp_path / "b.py").write_text("from . import a\n")
    assert cycles(import_graph((tmp_path, "pkg"))) == [["pkg.a", "pkg.b"]]


def test_resources_imports_no_feature() -> None:
    graph = import_graph((ROOT / "service", "tierckpt.service"))
    infrastructure = {
        f"tierckpt.service.{name}"
        for name in (
            "config",
            "db",
            "row_reads",
            "storage.base",
            "storage.factory",
            "storage.posix",
            "storage.s3",
        )
    }
    assert graph["tierckpt.service.resources"] <= infrastructure


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_module_over_the_size_limit(folder: str) -> None:
    oversized = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        source = path.read_text()
        lines = source.count("\n")
        if lines <= MAX_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if ONE_ALGORITHM not in docstring.lower():
            oversized.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not oversized, (
        f"modules over {MAX_LINES} lines whose docstring does not say they hold "
        f"{ONE_ALGORITHM!r}: {oversized}"
    )
