"""The memory tier as an upload reads it: a staged checkpoint's files, opened
from the segment while the agent still writes them to T0.

The agent's ``MemoryTier`` answers from its ``Arena``; a worker running in a
process of its own (worker_process.py) holds no arena, so ``ArenaReader``
answers from the segments' own files (``registration.json``, ``failed.json``,
``reservation.json``), which the agent writes atomically. Without it, that
worker's upload of a checkpoint staged in memory would find neither copy
until the T0 copy is renamed into place, and fail the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..whole_files import read_json
from .arena import DATA, FAILED, PREFIX, REGISTRATION, RESERVATION
from .persist import open_beneath


def open_data(data: Path, relative: str) -> int | None:
    """``data/relative`` open for reading, or None when it is gone (the
    upload reads T0 instead). Its bytes cannot change under the reader: the
    agent never rewrites a segment's file, it only unlinks it (arena.py)."""
    try:
        return open_beneath(data, relative)
    except OSError:
        return None


class ArenaReader:
    """Opens the memory copy of a registered T0 file from an arena directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def open_file(self, shard_path: Path, relative: str) -> int | None:
        target = str(shard_path)
        try:
            entries = [e for e in os.scandir(self.root) if e.name.startswith(PREFIX)]
        except OSError:
            return None
        for entry in entries:
            directory = Path(entry.path)
            try:
                registration = read_json(directory / REGISTRATION)
                reservation = read_json(directory / RESERVATION)
            except (OSError, ValueError):
                continue  # being removed, or not a segment
            if (
                not registration
                or registration.get("path") != target
                or not reservation
                or relative not in reservation.get("files", {})
                or (directory / FAILED).exists()
            ):
                continue
            return open_data(directory / DATA, relative)
        return None
