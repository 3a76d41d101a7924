"""Prefetched copies on T0 (service/prefetch/copies.py): the marker, which
ranks count as intact, path confinement and removal."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tierckpt.service.config import Settings
from tierckpt.service.prefetch import copies

CHECKPOINT_ID = 7


def settings(tmp_path: Path) -> Settings:
    return Settings.model_validate({"local": {"roots": [str(tmp_path / "ssd")]}})


def make_copy(
    directory: Path, files: dict[tuple[int, str], bytes]
) -> list[tuple[int, str, int, str]]:
    """Write a complete prefetched copy; the catalog's (rank, path, size, sha256)."""
    recorded = []
    catalog = []
    for (rank, path), data in files.items():
        target = copies.rank_dir(directory, rank) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        recorded.append(copies.CopiedFile(rank, path, len(data), sha, target.stat().st_mtime_ns))
        catalog.append((rank, path, len(data), sha))
    copies.write_marker(directory, copies.Marker("r", 5, CHECKPOINT_ID, tuple(recorded)))
    return catalog


def test_the_marker_round_trips_and_refuses_what_it_does_not_know() -> None:
    marker = copies.Marker("r", 5, 9, (copies.CopiedFile(1, "a/b", 3, "f" * 64, 123),))
    assert copies.Marker.from_json(marker.to_json()) == marker
    assert copies.Marker.from_json(b"not json") is None
    assert copies.Marker.from_json(b'{"version": 99}') is None
    assert copies.Marker.from_json(b'{"version": 1, "files": [{}]}') is None


def test_a_rank_is_intact_only_while_every_file_matches(tmp_path: Path) -> None:
    directory = copies.step_dir(settings(tmp_path), "r", 5)
    catalog = make_copy(directory, {(0, "w.bin"): b"zero", (1, "w.bin"): b"one", (1, "m/x"): b"x"})
    both = {0: str(copies.rank_dir(directory, 0)), 1: str(copies.rank_dir(directory, 1))}
    assert copies.intact_ranks(directory, CHECKPOINT_ID, catalog) == both
    # Another checkpoint at the same step (deleted and registered again): nothing.
    assert copies.intact_ranks(directory, CHECKPOINT_ID + 1, catalog) == {}
    # The catalog says other bytes for a file: that rank is not this copy.
    changed = [(r, p, s, "0" * 64 if (r, p) == (1, "m/x") else h) for r, p, s, h in catalog]
    assert copies.intact_ranks(directory, CHECKPOINT_ID, changed) == {0: both[0]}
    # A file rewritten on disk (its mtime moves): that rank goes.
    target = copies.rank_dir(directory, 0) / "w.bin"
    info = target.stat()
    target.write_bytes(b"ZERO")
    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert copies.intact_ranks(directory, CHECKPOINT_ID, catalog) == {1: both[1]}
    # Without the marker (removed first by a new prefetch or an eviction): nothing.
    (directory / copies.MARKER).unlink()
    assert copies.intact_ranks(directory, CHECKPOINT_ID, catalog) == {}


def test_own_copies_need_their_registered_size_and_mtime(tmp_path: Path) -> None:
    shard = tmp_path / "ssd" / "step-5"
    shard.mkdir(parents=True)
    (shard / "w.bin").write_bytes(b"w")
    mtime = (shard / "w.bin").stat().st_mtime_ns
    shards = [(0, "node-a", str(shard)), (1, "node-b", "/elsewhere")]
    files = [(0, "w.bin", 1, mtime), (1, "w.bin", 1, mtime)]
    assert copies.own_intact_ranks("node-a", shards, files) == {0: str(shard)}
    assert copies.own_intact_ranks("node-a", shards, [(0, "w.bin", 1, mtime + 1)]) == {}
    assert copies.own_intact_ranks("node-a", shards, [(0, "w.bin", 1, None)]) == {}
    assert copies.own_intact_ranks("node-c", shards, files) == {}


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../../x", "a\x00b"])
def test_paths_are_confined(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        copies.confined(tmp_path, bad)


def test_a_symlink_out_is_refused(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "out").symlink_to(tmp_path)
    with pytest.raises(ValueError):
        copies.confined(tmp_path / "base", "out/x")
    assert copies.confined(tmp_path / "base", "in/x") == tmp_path / "base" / "in" / "x"


def test_held_and_remove(tmp_path: Path) -> None:
    config = settings(tmp_path)
    for step in (5, 6):
        make_copy(copies.step_dir(config, "r", step), {(0, "w.bin"): b"w"})
    (copies.prefetch_root(config) / "r" / "not-a-step").mkdir()
    assert copies.held(config) == {"r": [5, 6]}
    assert copies.remove(config, "r", 5) is True
    assert copies.remove(config, "r", 5) is False
    assert copies.held(config) == {"r": [6]}
    assert copies.remove(config, "r", 6) is True
    assert copies.held(config) == {}


def test_remove_refuses_a_copy_that_is_a_link(tmp_path: Path) -> None:
    config = settings(tmp_path)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    link = copies.step_dir(config, "r", 5)
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    with pytest.raises(ValueError):
        copies.remove(config, "r", 5)
    assert (outside / "keep").exists()


def test_a_copy_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    config = settings(tmp_path)
    directory = copies.step_dir(config, "r", 5)
    directory.mkdir(parents=True)
    copies.check_unlinked(config, directory)  # a plain directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = copies.prefetch_root(config) / "x"
    run.symlink_to(elsewhere)
    linked = copies.step_dir(config, "x", 5)
    linked.mkdir()
    with pytest.raises(ValueError):
        copies.check_unlinked(config, linked)
