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


def test_recycled_files_are_written_through_kept_mappings(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=10 << 20, lease_seconds=60)
    arena.open()
    mappings = Mappings()
    model = torch.nn.Linear(64, 64)
    inodes = []
    for step in range(1, 7):
        with torch.no_grad():
            model.weight.add_(1.0)
        staged = StagedFiles.of(encode_state(step=step, model=model))
        segment = arena.reserve("r", step, 0, 1, staged.sizes())
        staged.write(segment.data, mappings)
        arena.check_complete(segment)
        write_state(tmp_path / f"disk-{step}", fsync=False, step=step, model=model)
        for name in staged.sizes():
            assert (segment.data / name).read_bytes() == (
                tmp_path / f"disk-{step}" / name
            ).read_bytes(), (step, name)
        inodes.append((segment.data / "model.safetensors").stat().st_ino)
        arena.mark_persisted(segment, f"/t0/{step}")
        arena.free_older(segment, keep_newest=True)
        if step == 4:
            mapped = {key: found[1] for key, found in mappings._maps.items()}
    # Steps 1 and 2 wrote sparse new files (pwrite); every later step got the
    # files of the step before last back. Steps 3 and 4 mapped them; steps 5
    # and 6 wrote through those same mappings: none was added.
    assert inodes[2] == inodes[4] == inodes[0] and inodes[3] == inodes[5] == inodes[1]
    assert len(mappings._maps) == 4  # two saves × two safetensors files
    assert {key: found[1] for key, found in mappings._maps.items()} == mapped
    mappings.close()
    assert mappings._maps == {}


def test_a_spare_still_read_by_an_upload_is_not_handed_out(tmp_path: Path) -> None:
    import fcntl
    import os

    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    first = arena.reserve("r", 1, 0, 1, {"a": 100})
    (first.data / "a").write_bytes(b"x" * 100)
    reader = os.open(first.data / "a", os.O_RDONLY)  # an upload reading it from memory
    fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)
    arena.mark_persisted(first, "/t0/r/step-1")
    arena.release(first.id)
    second = arena.reserve("r", 2, 0, 1, {"a": 100})
    # A new file, not the one being read, whose bytes stay as they were; the
    # spare left the pool, so the budget counts the new file only (the CI
    # once saw 2 segments' worth counted against a budget for one).
    assert os.fstat(reader).st_ino != (second.data / "a").stat().st_ino
    assert os.pread(reader, 100, 0) == b"x" * 100
    assert arena.used == 100 and arena.spares.total == 0
    os.close(reader)
    arena.release(second.id)
    third = arena.reserve("r", 3, 0, 1, {"a": 100})
    assert arena.used <= 1000 and (third.data / "a").stat().st_size == 100


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
    # Handed out with every file at its size (sparse, or a spare's pages).
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


def test_freed_segments_give_their_files_to_the_next_reservation(tmp_path: Path) -> None:
    arena = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    arena.open()
    first = arena.reserve("r", 1, 0, 1, {"big": 500, "small": 100})
    inodes = {(first.data / n).stat().st_ino for n in ("big", "small")}
    arena.mark_persisted(first, "/t0/r/step-1")
    arena.release(first.id)
    assert arena.used == 600 and arena.spares.total == 600  # the pages are kept
    second = arena.reserve("r", 2, 0, 1, {"model": 400, "state": 90, "json": 5})
    # Each file gets the spare that holds it best; cut to its size.
    assert (second.data / "model").stat().st_ino in inodes
    assert (second.data / "state").stat().st_ino in inodes
    assert (second.data / "json").stat().st_ino not in inodes
    assert [(second.data / n).stat().st_size for n in ("model", "state", "json")] == [400, 90, 5]
    assert arena.used == 495 and arena.spares.total == 0
    # Spares are the first freed when room is needed; kept across restarts.
    arena.release(second.id)
    again = Arena(tmp_path / "arena", budget=1000, lease_seconds=60)
    again.open()
    assert again.used == 495
    third = again.reserve("r", 3, 0, 1, {"whole": 900})  # the 400-byte spare, grown
    assert again.used == 995 and again.spares.total == 95
    assert (third.data / "whole").stat().st_size == 900
    again.reserve("r", 4, 0, 1, {"more": 50})  # the 90-byte spare, cut to 50
    assert again.used == 955 and again.spares.total == 5


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
