"""Nothing outside tests/ imports the test suite.

benchmarks/, examples/ and devsupport/ run without the test package (the
benchmarks and the demo use `devsupport`, the development helpers). The check
reads each module's syntax tree, so every import counts: top level, inside a
function, under `if TYPE_CHECKING:`, and `importlib.import_module("tests…")`
or `__import__("tests…")` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("benchmarks", "examples", "devsupport")
FORBIDDEN = "tests"


def _names_a_forbidden_module(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


def forbidden_imports(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, module) of every import of the test package in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name) for a in node.names if _names_a_forbidden_module(a.name)
            ]
        elif isinstance(node, ast.ImportFrom):
            # A relative import stays inside its own top-level package.
            if node.level == 0 and node.module and _names_a_forbidden_module(node.module):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            first = node.args[0]
            if (
                called in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _names_a_forbidden_module(first.value)
            ):
                found.append((node.lineno, first.value))
    return found


def _modules(root: str) -> list[Path]:
    return sorted((REPO / root).rglob("*.py"))


@pytest.mark.parametrize("root", ROOTS)
def test_no_module_outside_tests_imports_the_test_package(root: str) -> None:
    modules = _modules(root)
    assert modules, f"no Python module under {root}/: the check would pass vacuously"
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in modules
        for line, module in forbidden_imports(path.read_text(), str(path))
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "source",
    [
        "import tests",
        "import tests.support.seaweed as seaweed",
        "from tests.support import postgres",
        "from tests import conftest",
        "def f():\n    from tests.unit import helpers\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tests.e2e\n",
        "import importlib\nimportlib.import_module('tests.support.agent')\n",
        "__import__('tests')\n",
    ],
)
def test_the_check_sees_each_form_of_import(source: str) -> None:
    assert forbidden_imports(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "import testsuite",
        "from testing import x",
        "from devsupport.seaweed import SeaweedServer",
        "from .tests import helper",  # relative: inside its own package
        "import pytest\npytest.importorskip('tests_extra')\n",
    ],
)
def test_the_check_leaves_other_imports_alone(source: str) -> None:
    assert forbidden_imports(source) == []
