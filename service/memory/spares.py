"""Files of freed segments, kept with their pages for the next reservations.

Writing into fresh tmpfs pages costs the trainer about twice the copy
itself (every page is allocated and zeroed on first touch), so a freed
segment's files are not deleted but moved here, and a new reservation gets
them back, renamed into its own directory and cut to the size it asked for.
The trainer then writes into pages that exist already (and, with the file's
inode unchanged, through a mapping it may have kept:
client/torch/segment_mappings.py).

Spares count against the arena's budget like segments and are the first
thing deleted when room is needed.

An upload may still read a freed segment's file (it reads a checkpoint from
memory while the agent writes it to T0, which may free the segment before
the upload ends): it holds a shared ``flock`` on it
(service.py, ``open_file``). A spare is only handed out under an exclusive
one; one being read is left alone (the reservation gets a new file), since
rewriting it would change the bytes under the upload. Deleting it is
harmless: the reader keeps its descriptor.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterable
from pathlib import Path


class SparePool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[Path, int] = {}  # spare file -> its size

    @property
    def total(self) -> int:
        return sum(self.files.values())

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.files.clear()
        for entry in self.directory.iterdir():
            if entry.is_file() and not entry.is_symlink():
                self.files[entry] = entry.stat().st_size
            else:
                entry.unlink(missing_ok=True)

    def add(self, path: Path) -> None:
        """Keep ``path`` (a freed segment's file) for a later reservation."""
        spare = self.directory / uuid.uuid4().hex
        os.rename(path, spare)
        self.files[spare] = spare.stat().st_size

    def plan(self, sizes: dict[str, int]) -> dict[str, Path]:
        """A spare for as many of ``sizes``' files as possible, largest file
        first: the smallest spare that holds it, else the largest one left."""
        left = dict(self.files)
        chosen: dict[str, Path] = {}
        for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
            if size == 0 or not left:
                continue
            fitting = [p for p, s in left.items() if s >= size]
            pick = (
                min(fitting, key=lambda p: left[p]) if fitting else max(left, key=lambda p: left[p])
            )
            chosen[name] = pick
            del left[pick]
        return chosen

    def take(self, spare: Path, destination: Path, size: int) -> bool:
        """Move ``spare`` to ``destination``, cut (or grown) to ``size``;
        False while an upload still reads it: the spare then leaves the pool
        (unlinked: the reader keeps its bytes until it closes them), since
        the reservation that planned on it writes a new file instead, and the
        budget must not count both."""
        fd = os.open(spare, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                spare.unlink(missing_ok=True)
                del self.files[spare]
                return False
            os.rename(spare, destination)
            # Truncating moves the mtime too: a reader that opened it just
            # before the lock sees the file changed and reads T0 instead.
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        del self.files[spare]
        return True

    def evict(self, nbytes: int, keep: Iterable[Path] = ()) -> int:
        """Delete spares (largest first, never those in ``keep``) until
        ``nbytes`` are freed or none is left; the bytes freed."""
        kept = set(keep)
        freed = 0
        for spare in sorted(self.files, key=lambda p: -self.files[p]):
            if freed >= nbytes:
                break
            if spare in kept:
                continue
            spare.unlink(missing_ok=True)
            freed += self.files.pop(spare)
        return freed
