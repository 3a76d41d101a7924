"""A segment reserved ahead (the next save's, answered with the staging of
the last one): no step until it is staged, the step and the sizes its files
were written with read back by a restarted agent, and growth refused past
the budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.service.errors import BadInput
from tierckpt.service.memory.arena import Arena, MemoryFull

FILES = {"model.bin": 4096, "nested/state.json": 10}


def _arena(tmp_path: Path, budget: int = 1 << 20) -> Arena:
    arena = Arena(tmp_path / "arena", budget=budget, lease_seconds=600)
    arena.open()
    return arena


def test_the_step_and_the_sizes_written_are_read_back(tmp_path: Path) -> None:
    arena = _arena(tmp_path)
    segment = arena.reserve("run", None, 0, 1, dict(FILES), evict=False)
    assert _arena(tmp_path).segments[segment.id].step is None
    (segment.data / "model.bin").write_bytes(b"m" * 4096)
    (segment.data / "nested/state.json").write_bytes(b'{"loss": 0.25}')  # 14 bytes, not 10
    arena.adopt(segment, 42)
    again = _arena(tmp_path).segments[segment.id]
    assert (again.step, again.files, again.nbytes) == (
        42,
        {"model.bin": 4096, "nested/state.json": 14},
        4110,
    )


def test_growth_past_the_budget_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    arena = _arena(tmp_path, budget=8192)
    segment = arena.reserve("run", None, 0, 1, {"model.bin": 4096}, evict=False)
    (segment.data / "model.bin").write_bytes(b"m" * 9000)
    with pytest.raises(MemoryFull):
        arena.adopt(segment, 1)
    assert segment.files == {"model.bin": 4096} and arena.used == 4096
    assert segment.step is None


def test_other_files_are_left_to_the_completeness_check(tmp_path: Path) -> None:
    arena = _arena(tmp_path)
    segment = arena.reserve("run", None, 0, 1, {"model.bin": 4096}, evict=False)
    (segment.data / "model.bin").write_bytes(b"m" * 4096)
    (segment.data / "extra.bin").write_bytes(b"x")
    with pytest.raises(BadInput, match="unexpected"):
        arena.adopt(segment, 1)
    assert segment.files == {"model.bin": 4096} and segment.step is None
