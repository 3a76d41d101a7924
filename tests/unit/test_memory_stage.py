"""The memory tier's pieces without an agent: the files a trainer writes into
a segment equal write_state's byte for byte, and the arena's accounting
(budget, leases, eviction, rebuilt after a restart)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tierckpt.service.errors import BadInput
from tierckpt.service.memory.arena import Arena, MemoryFull

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from tierckpt.client.torch.checkpoint_dir import encode_state, write_state  # noqa: E402
from tierckpt.client.torch.memory_stage import (  # noqa: E402
    DTYPES,
    StagedFiles,
    safetensors_layout,
)
from tierckpt.client.torch.segment_mappings import Mappings  # noqa: E402


def _write_layout(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    staged = StagedFiles(
        layouts={path.name: safetensors_layout(tensors, {"format": "pt"})},
        small={},
        objects=None,
    )
    staged.write(path.parent)


def test_every_dtype_is_laid_out_as_save_file_writes_it(tmp_path: Path) -> None:
    tensors = {}
    for index, dtype in enumerate(DTYPES):
        values = torch.arange(7, dtype=torch.float32).reshape(7) * (index + 1)
        tensors[f"t{index:02d}-{dtype}"] = values.to(dtype)
    tensors["empty"] = torch.zeros(0, 3)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    tensors["z-last-name"] = torch.ones(2, 2, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    _write_layout(tmp_path / "mine.safetensors", tensors)
    assert (tmp_path / "mine.safetensors").read_bytes() == (
        tmp_path / "reference.safetensors"
    ).read_bytes()
    loaded = load_file(str(tmp_path / "mine.safetensors"))
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        raw = loaded[name].reshape(-1).view(torch.uint8)
        assert torch.equal(raw, tensor.reshape(-1).view(torch.uint8))


def test_a_staged_state_is_the_files_write_state_makes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    state = {"step": 3, "model": model, "optimizer": optimizer, "extra": {"seen": {1, 2}}}
    staged = StagedFiles.of(encode_state(**state))
    (tmp_path / "memory").mkdir()
    staged.write(tmp_path / "memory")
    write_state(tmp_path / "disk", fsync=False, **state)
    names = sorted(p.name for p in (tmp_path / "disk").iterdir())
    assert names == sorted(staged.sizes())  # objects.pt included: a set is no JSON
    for name in names:
        mine = (tmp_path / "memory" / name).read_bytes()
        assert mine == (tmp_path / "disk" / name).read_bytes(), name
        assert len(mine) == staged.sizes()[name]


def test_a_segment_that_cannot_be_written_raises_instead_of_crashing(tmp_path: Path) -> None:
    staged = StagedFiles.of(encode_state(step=1, extra={"x": torch.ones(4)}))
    with pytest.raises(OSError):
        staged.write(tmp_path / "missing")


def test_saves_write_through_the_mapping_prepared_ahead_and_keep_none(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=10 << 20, lease_seconds=60)
    arena.open()
    mappings = Mappings()
    model = torch.nn.Linear(64, 64)
    ahead = None
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.add_(1.0)
        staged = StagedFiles.of(encode_state(step=step, model=model))
        segment = ahead or arena.reserve("r", step, 0, 1, staged.sizes())
        if ahead is not None:
            mappings._settle()
            # The prepared files are mapped, their pages allocated: no holes.
            assert len(mappings._maps) == 2  # the two safetensors files
            for name in ("model.safetensors", "state.safetensors"):
                info = (segment.data / name).stat()
                assert info.st_blocks * 512 >= info.st_size
        staged.write(segment.data, mappings)
        assert mappings._maps == {}  # nothing kept past its save
        if ahead is not None:
            arena.adopt(segment, step)
        arena.check_complete(segment)
        write_state(tmp_path / f"disk-{step}", fsync=False, step=step, model=model)
        for name in staged.sizes():
            assert (segment.data / name).read_bytes() == (
                tmp_path / f"disk-{step}" / name
            ).read_bytes(), (step, name)
        arena.mark_persisted(segment, f"/t0/{step}")
        arena.free_older(segment, keep_newest=True)
        ahead = arena.reserve("r", None, 0, 1, staged.sizes(), evict=False)
        mappings.prepare(ahead.data, {name: staged.sizes()[name] for name in staged.layouts})
    mappings.close()
    assert mappings._maps == {}


def test_a_freed_file_is_never_rewritten_under_a_reader_that_maps_it(tmp_path: Path) -> None:
    """A restore that mapped a segment's file (safetensors' load_file does)
    and an upload that reads it keep their bytes whatever the arena does
    next: freed files are unlinked, and every reservation gets new files."""
    import mmap
    import os

    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    first = arena.reserve("r", 1, 0, 1, {"state": 400, "json": 8})
    (first.data / "state").write_bytes(b"x" * 400)
    (first.data / "json").write_bytes(b"{}      ")
    reader = os.open(first.data / "state", os.O_RDONLY)
    mapped = mmap.mmap(reader, 400, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    inode = os.fstat(reader).st_ino
    arena.mark_persisted(first, "/t0/r/step-1")
    arena.release(first.id)
    assert os.fstat(reader).st_nlink == 0  # unlinked, not kept for reuse
    for step in range(2, 12):  # reservations of other sizes, written through
        sizes = {"state": 37 * step, "json": 400 - 37 * step % 300}
        segment = arena.reserve("r", step, 0, 1, sizes)
        for name, size in sizes.items():
            assert (segment.data / name).stat().st_ino != inode
            (segment.data / name).write_bytes(bytes([step]) * size)
        arena.mark_persisted(segment, f"/t0/r/step-{step}")
        arena.release(segment.id)
        assert mapped[:] == b"x" * 400 and os.pread(reader, 400, 0) == b"x" * 400
    assert arena.used == 0
    mapped.close()
    os.close(reader)


def _files(size: int) -> dict[str, int]:
    return {"a.bin": size}


def test_budget_refuses_then_evicts_persisted_segments(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    first = arena.reserve("r", 1, 0, 1, _files(600))
    with pytest.raises(MemoryFull) as full:
        arena.reserve("r", 2, 0, 1, _files(600))
    assert full.value.code == "memory_full" and full.value.status == 507
    with pytest.raises(MemoryFull) as too_large:
        arena.reserve("r", 2, 0, 1, _files(1001))
    assert too_large.value.code == "segment_too_large"
    # Staged: it must reach T0 first, so it is not evicted.
    (first.data / "a.bin").write_bytes(b"x" * 600)
    arena.check_complete(first)
    arena.stage(first, {"run": "r", "step": 1, "path": "/t0/r/step-1"})
    with pytest.raises(MemoryFull):
        arena.reserve("r", 2, 0, 1, _files(600))
    arena.mark_persisted(first, "/t0/r/step-1")
    second = arena.reserve("r", 2, 0, 1, _files(600))
    assert list(arena.segments) == [second.id]
    assert not first.directory.exists()


def test_segments_that_do_not_hold_the_reserved_files_are_refused(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    segment = arena.reserve("r", 1, 0, 1, {"a": 3, "d/b": 2})
    # Handed out with every file at its size (new, sparse files).
    assert {p.name: p.stat().st_size for p in segment.data.rglob("*") if p.is_file()} == {
        "a": 3,
        "b": 2,
    }
    (segment.data / "a").write_bytes(b"abc")
    (segment.data / "d" / "b").unlink()
    with pytest.raises(BadInput, match=r"missing \['d/b'\]"):
        arena.check_complete(segment)
    (segment.data / "d" / "b").write_bytes(b"toolong")
    with pytest.raises(BadInput, match=r"wrong size \['d/b'\]"):
        arena.check_complete(segment)
    (segment.data / "d" / "b").write_bytes(b"ok")
    (segment.data / "extra").write_bytes(b"")
    with pytest.raises(BadInput, match=r"unexpected \['extra'\]"):
        arena.check_complete(segment)
    (segment.data / "extra").unlink()
    arena.check_complete(segment)


def test_freed_segments_give_their_room_not_their_files(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    first = arena.reserve("r", 1, 0, 1, {"big": 500, "small": 100})
    arena.mark_persisted(first, "/t0/r/step-1")
    arena.release(first.id)
    assert arena.used == 0 and not first.directory.exists()
    second = arena.reserve("r", 2, 0, 1, {"whole": 1000})
    assert (second.data / "whole").stat().st_size == 1000
    assert (second.data / "whole").stat().st_blocks == 0  # new and sparse
    # An arena an older agent left with a pool of freed files: dropped at start.
    spares = tmp_path / "arena" / "spare"
    spares.mkdir()
    (spares / "0123").write_bytes(b"x" * 300)
    again = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    again.open()
    assert not spares.exists() and again.used == 1000


def test_reopened_arena_rebuilds_its_accounting_and_drops_half_made_segments(
    tmp_path: Path,
) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    staged = arena.reserve("r", 1, 0, 1, _files(100))
    (staged.data / "a.bin").write_bytes(b"x" * 100)
    arena.stage(staged, {"run": "r", "step": 1, "path": "/t0/r/step-1"})
    reserved = arena.reserve("r", 2, 0, 1, _files(200))
    half_made = tmp_path / "arena" / "seg-half"
    half_made.mkdir()  # killed before its reservation was written
    again = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    again.open()
    assert again.used == 300
    assert {s.id: s.state for s in again.segments.values()} == {
        staged.id: "staged",
        reserved.id: "reserved",
    }
    assert [s.id for s in again.staged()] == [staged.id]
    assert not half_made.exists()
    assert json.loads((staged.directory / "registration.json").read_text())["step"] == 1


def test_expired_reservations_are_reclaimed_staged_ones_never(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=5)
    arena.open()
    reserved = arena.reserve("r", 1, 0, 1, _files(100))
    staged = arena.reserve("r", 2, 0, 1, _files(100))
    (staged.data / "a.bin").write_bytes(b"x" * 100)
    arena.stage(staged, {"run": "r", "step": 2, "path": "/t0/r/step-2"})
    assert arena.reclaim_abandoned(now=time.time()) == []
    assert arena.reclaim_abandoned(now=time.time() + 10) == [reserved.id]
    assert list(arena.segments) == [staged.id]


def test_only_the_newest_persisted_segment_of_a_run_and_rank_is_kept(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=10_000, lease_seconds=60)
    arena.open()
    segments = {}
    for run, step, rank in (("r", 1, 0), ("r", 2, 0), ("r", 2, 1), ("other", 1, 0)):
        segment = arena.reserve(run, step, rank, 2, _files(10))
        arena.mark_persisted(segment, f"/t0/{run}/{step}/{rank}")
        segments[(run, step, rank)] = segment
    arena.free_older(segments[("r", 2, 0)], keep_newest=True)
    kept = {(s.run, s.step, s.rank) for s in arena.segments.values()}
    assert kept == {("r", 2, 0), ("r", 2, 1), ("other", 1, 0)}
    arena.free_older(segments[("other", 1, 0)], keep_newest=False)
    assert ("other", 1, 0) not in {(s.run, s.step, s.rank) for s in arena.segments.values()}
