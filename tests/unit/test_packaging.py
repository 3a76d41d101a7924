"""Building the distribution is silent and ships every module.

The build is driven the way pip drives it (setuptools' PEP 517 hooks, the
warnings they raise collected as pip collects them and shows them to the
user), on a copy of the sources so the checkout gains no build/ or egg-info.
A build warning, or a module of service/, client/ or migrations/ missing
from the wheel, fails here rather than on a user's first screen.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REMAPPED = {
    "service": "tierckpt/service",
    "client": "tierckpt/client",
    "migrations": "tierckpt/migrations",
}
SOURCES = ["pyproject.toml", "setup.py", "README.md", *REMAPPED]

# Runs each hook as pip's in-process helper does: every warning recorded and
# reported, whatever the filters of the calling environment.
DRIVER = """
import json, sys, warnings
from setuptools import build_meta

out = sys.argv[1]
report = {}
for hook in ("build_sdist", "build_wheel", "build_editable"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = getattr(build_meta, hook)(out)
    report[hook] = {"file": name, "warnings": [str(w.message) for w in caught]}
print("REPORT " + json.dumps(report))
"""


def build(tmp_path: Path) -> tuple[dict[str, dict[str, object]], str, Path]:
    source = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    dist.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SETUPTOOLS"))}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(dist)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    report = json.loads(next(line for line in lines if line.startswith("REPORT "))[7:])
    return report, done.stdout + done.stderr, dist


def test_build_is_silent_and_ships_every_module(tmp_path: Path) -> None:
    report, output, dist = build(tmp_path)

    for hook, result in report.items():
        assert result["warnings"] == [], f"{hook} warned:\n" + "\n".join(result["warnings"])
    # distutils-style log warnings ("warning: ...") do not go through `warnings`.
    logged = [line for line in output.splitlines() if line.lower().startswith("warning")]
    assert logged == []

    wheel = dist / str(report["build_wheel"]["file"])
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
        entry_points = next(n for n in shipped if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    expected = {
        f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, target in REMAPPED.items()
        for path in (ROOT / folder).rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix == ".py" or path.name == "script.py.mako")
    }
    assert "tierckpt/migrations/script.py.mako" in expected
    assert any(name.startswith("tierckpt/migrations/versions/") for name in expected)
    assert expected - shipped == set()
    assert "tierckpt = tierckpt.client.cli:main" in scripts
