"""The worker process loads no web framework: it starts with every agent (and
again after each restart of its own), and FastAPI with Starlette cost it a
fifth of a second of CPU per start on a 2-core node for nothing it uses.
The modules it loads are those worker_process.py imports, at module level
and inside its functions (read from its source), and what they import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tierckpt.service.worker_process as worker_process

WEB = ("fastapi", "starlette", "uvicorn", "jinja2")


def _imported_by(path: Path, package: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:  # from .x import y: the module x
                names.append(f"{package}.{node.module}")
            else:  # from . import x: the module x
                names.extend(f"{package}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return sorted(set(names))


def test_the_worker_process_loads_no_web_framework() -> None:
    modules = _imported_by(Path(worker_process.__file__), "tierckpt.service")
    assert "tierckpt.service.background" in modules  # its work, imported where it runs
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        if name.startswith('tierckpt'):\n"
        "            raise\n"
        "        # else an optional module (uvloop)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {WEB!r}))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
