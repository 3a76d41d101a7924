"""Prefetched copies on a node's T0: where they live, their marker, and
whether one is still intact.

A prefetch (``prefetch/jobs.py``) brings a valid checkpoint that this node
did not write into its T0, for a restart here:

    <first [local].roots>/.tierckpt-prefetch/<run>/step-<step:012d>/
        rank-<rank:05d>/<relative path>     # each file verified, fsynced, renamed
        PREFETCHED.json                     # written last: the commit marker

The marker lists every file with its catalog identity (rank, path, size,
SHA-256) and the size and mtime it had once verified. It is written (tmp,
fsync, rename) only after every file is in place, and removed first when the
copy goes, so a copy without it is never offered. A rank of the copy is
*intact* when its marker entries match the catalog's files and every file
still has the size and mtime the marker recorded: the same test `latest`
applies to a node's own T0 copies (``own_intact_ranks``), which the agent
hashed when it uploaded them.

Run names and relative paths were validated at registration; every path is
still built through ``confined`` (no '..', no absolute path, no symlink on
the way), so a catalog row can never make this module write or delete
outside the prefetch directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ...client._files import fsync_dir
from ..config import Settings

DIRECTORY = ".tierckpt-prefetch"
MARKER = "PREFETCHED.json"
MARKER_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{12})$")


@dataclass(frozen=True)
class CopiedFile:
    """One file of a prefetched copy: its catalog identity and what it was
    on disk once verified."""

    rank: int
    path: str
    size: int
    sha256: str
    mtime_ns: int


@dataclass(frozen=True)
class Marker:
    run: str
    step: int
    checkpoint_id: int
    files: tuple[CopiedFile, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": MARKER_VERSION,
                "run": self.run,
                "step": self.step,
                "checkpoint_id": self.checkpoint_id,
                "files": [asdict(f) for f in self.files],
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Marker | None:
        """The marker, or None when it is not one this version wrote."""
        try:
            doc: Any = json.loads(data)
            if doc.get("version") != MARKER_VERSION:
                return None
            files = tuple(
                CopiedFile(
                    int(f["rank"]),
                    str(f["path"]),
                    int(f["size"]),
                    str(f["sha256"]),
                    int(f["mtime_ns"]),
                )
                for f in doc["files"]
            )
            return cls(str(doc["run"]), int(doc["step"]), int(doc["checkpoint_id"]), files)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def prefetch_root(settings: Settings) -> Path:
    return Path(os.path.abspath(settings.local.roots[0])) / DIRECTORY


def step_dir(settings: Settings, run: str, step: int) -> Path:
    return prefetch_root(settings) / run / f"step-{step:012d}"


def rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}"


def confined(base: Path, relative: str) -> Path:
    """``base / relative``, refused (ValueError) unless it stays under
    ``base`` once every symbolic link on the way is resolved."""
    rel = PurePosixPath(relative)
    if not relative or rel.is_absolute() or ".." in rel.parts or "\x00" in relative:
        raise ValueError(f"refusing unsafe path {relative!r}")
    path = base / rel
    real_base = Path(os.path.realpath(base))
    if not Path(os.path.realpath(path)).is_relative_to(real_base):
        raise ValueError(f"{relative!r} leads out of {base}")
    return path


def check_unlinked(settings: Settings, directory: Path) -> None:
    """Refuse (ValueError) a copy's directory reached through a symbolic link
    (someone who may write T0 planted one): the agent would write where the
    link leads."""
    real_root = Path(os.path.realpath(settings.local.roots[0]))
    expected = real_root / directory.relative_to(prefetch_root(settings).parent)
    if Path(os.path.realpath(directory)) != expected:
        raise ValueError(f"{directory} leads elsewhere through a symbolic link; refusing it")


def read_marker(directory: Path) -> Marker | None:
    try:
        return Marker.from_json((directory / MARKER).read_bytes())
    except OSError:
        return None


def write_marker(directory: Path, marker: Marker) -> None:
    """The commit marker, atomically: tmp, fsync, rename, fsync the directory."""
    tmp = directory / f".{MARKER}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(marker.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    os.rename(tmp, directory / MARKER)
    fsync_dir(directory)


def unchanged(path: Path, size: int, mtime_ns: int) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return info.st_size == size and info.st_mtime_ns == mtime_ns


def intact_ranks(
    directory: Path, checkpoint_id: int, files: Iterable[tuple[int, str, int, str | None]]
) -> dict[int, str]:
    """The ranks of the prefetched copy in ``directory`` that are intact
    (module docstring), each with its directory; ``files`` are the catalog's
    (rank, path, size, sha256). Blocking: call it in a thread."""
    marker = read_marker(directory)
    if marker is None or marker.checkpoint_id != checkpoint_id:
        return {}
    recorded = {(f.rank, f.path): f for f in marker.files}
    ranks: dict[int, bool] = {}
    for rank, path, size, sha256 in files:
        entry = recorded.get((rank, path))
        ok = (
            ranks.get(rank, True)
            and entry is not None
            and entry.size == size
            and entry.sha256 == sha256
            and unchanged(rank_dir(directory, rank) / path, entry.size, entry.mtime_ns)
        )
        ranks[rank] = bool(ok)
    return {rank: str(rank_dir(directory, rank)) for rank, ok in sorted(ranks.items()) if ok}


def own_intact_ranks(
    node: str,
    shards: Iterable[tuple[int, str | None, str]],
    files: Iterable[tuple[int, str, int, int | None]],
) -> dict[int, str]:
    """The ranks of a checkpoint whose own T0 copy (the directory it was
    registered from, ``shards``: rank, node, path) is on ``node`` and still
    has every file's size and mtime of the catalog (``files``: rank, path,
    size, mtime_ns). Blocking: call it in a thread."""
    mine = {rank: path for rank, shard_node, path in shards if shard_node == node}
    broken: set[int] = set()
    for rank, path, size, mtime_ns in files:
        if rank not in mine or rank in broken:
            continue
        if mtime_ns is None or not unchanged(Path(mine[rank]) / path, size, mtime_ns):
            broken.add(rank)
    return {rank: path for rank, path in sorted(mine.items()) if rank not in broken}


def held(settings: Settings) -> dict[str, list[int]]:
    """The prefetched copies on this node: run -> steps (any state, marker
    or not: retention also removes what a killed prefetch left)."""
    root = prefetch_root(settings)
    found: dict[str, list[int]] = {}
    try:
        runs = list(root.iterdir())
    except OSError:
        return found
    for run in runs:
        if run.is_symlink() or not run.is_dir():
            continue
        try:
            steps = [m for e in run.iterdir() if (m := _STEP_DIR.match(e.name))]
        except OSError:
            continue
        if steps:
            found[run.name] = sorted(int(m.group(1)) for m in steps)
    return found


def remove(settings: Settings, run: str, step: int) -> bool:
    """Remove a prefetched copy, its marker first (so a half-removed copy is
    never offered); False when there was none."""
    root = prefetch_root(settings)
    directory = step_dir(settings, run, step)
    real = Path(os.path.realpath(directory))
    if directory.is_symlink() or not real.is_relative_to(Path(os.path.realpath(root))):
        raise ValueError(f"{directory} is not a prefetched copy under {root}; refusing to remove")
    if not directory.is_dir():
        return False
    (directory / MARKER).unlink(missing_ok=True)
    fsync_dir(directory)
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()  # the run's last copy: its directory too
    except OSError:
        pass
    return True
