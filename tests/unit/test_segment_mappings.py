"""The trainer's mappings of the segment reserved for its next save, made
ahead of the save (client/torch/segment_mappings.py), on real tmpfs files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from service.memory.arena import Arena  # noqa: E402
from tierckpt.client.torch.checkpoint_dir import encode_state, write_state  # noqa: E402
from tierckpt.client.torch.memory_stage import StagedFiles, _pwrite_all  # noqa: E402
from tierckpt.client.torch.segment_mappings import Mappings  # noqa: E402


def _key(path: Path) -> tuple[int, int]:
    info = path.stat()
    return (info.st_dev, info.st_ino)


def _allocated(path: Path) -> bool:
    info = path.stat()
    return info.st_blocks * 512 >= info.st_size


def test_the_segment_reserved_ahead_is_mapped_before_its_save(
    tmp_path: Path, shm_dir: Path
) -> None:
    """The second save of a run gets a new sparse segment. Prepared while the
    trainer trains, its files' pages are allocated and mapped before the
    save, which copies through those very mappings (none made in its stall),
    byte-identical to write_state, and keeps none of them afterwards."""
    arena = Arena(shm_dir, budget=10 << 20, lease_seconds=60)
    arena.open()
    mappings = Mappings()
    try:
        model = torch.nn.Linear(64, 64)
        first = StagedFiles.of(encode_state(step=1, model=model))
        segment = arena.reserve("r", 1, 0, 1, first.sizes())
        first.write(segment.data, mappings)  # new sparse files: pwrite, nothing mapped
        assert mappings._maps == {}
        arena.check_complete(segment)
        ahead = arena.reserve("r", 2, 0, 1, first.sizes())
        layouts = {name: first.sizes()[name] for name in first.layouts}
        assert not any(_allocated(ahead.data / name) for name in layouts)

        mappings.prepare(ahead.data, layouts)
        mappings._settle()
        keys = {_key(ahead.data / name) for name in layouts}
        assert set(mappings._maps) == keys
        assert all(_allocated(ahead.data / name) for name in layouts)
        # A file mapped already is not prepared again: no thread, no new mapping.
        mappings.prepare(ahead.data, layouts)
        assert mappings._preparing is None

        targets = []
        target = mappings.target

        def recording(fd: int, size: int, used: set[tuple[int, int]]) -> object:
            found = target(fd, size, used)
            targets.append(found is not None)
            return found

        mappings.target = recording  # type: ignore[method-assign]
        with torch.no_grad():
            model.weight.add_(1.0)
        second = StagedFiles.of(encode_state(step=2, model=model))
        second.write(ahead.data, mappings)
        assert targets == [True, True]  # both files through their prepared mapping
        assert mappings._maps == {}  # dropped once the save is done
        write_state(tmp_path / "disk", fsync=False, step=2, model=model)
        for name in second.sizes():
            assert (ahead.data / name).read_bytes() == (tmp_path / "disk" / name).read_bytes()
    finally:
        mappings.close()
    assert mappings._maps == {}


def test_a_full_tmpfs_leaves_holes_that_the_save_writes_with_pwrite(
    tmpfs: Callable[[str, str], Path],
) -> None:
    """Preparing a file larger than what the tmpfs has left allocates what it
    can and stops, without a signal; the save sees the holes, writes with
    pwrite, and gets ENOSPC (the trainer then stages on T0) instead of a
    SIGBUS from a store into the mapping."""
    full = tmpfs("full", "size=1m")
    size = 4 << 20
    with open(full / "state.safetensors", "wb") as handle:
        handle.truncate(size)
    mappings = Mappings()
    mappings.prepare(full, {"state.safetensors": size})
    mappings._settle()
    fd = os.open(full / "state.safetensors", os.O_RDWR)
    try:
        assert not _allocated(full / "state.safetensors")
        assert mappings.target(fd, size, set()) is None
        with pytest.raises(OSError):
            _pwrite_all(fd, memoryview(b"x" * size), 0)
    finally:
        os.close(fd)
        mappings.close()


def test_a_segment_gone_before_its_preparation_is_skipped(tmp_path: Path) -> None:
    """The segment reserved ahead may be reclaimed before the trainer gets to
    it: its missing files are left to the save (which reserves anew)."""
    mappings = Mappings()
    mappings.prepare(tmp_path / "gone", {"state.safetensors": 4096})
    assert mappings._preparing is None and mappings._maps == {}
