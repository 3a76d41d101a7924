"""Fixtures of the end-to-end tests (the session-wide ones are in tests/conftest.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``mount(name, options)``: a new tmpfs under tmp_path mounted with
    ``options`` (a real small or full filesystem); unmounted after the test.
    Needs permission to mount (root): the test is skipped otherwise."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)
