"""The locks by which the agent knows a trainer still holds its segments.

While the checkpointer holds a reserved segment (the one reserved ahead for
the next save, between saves; a fresh one while it writes it), it keeps a
shared flock on the segment's ``holder`` file (the reservation's
``holder`` path). A trainer killed -9 drops the lock with its process, and
the agent frees the segment at once instead of at the end of its lease
(service/memory/holder.py), so the restarted trainer finds the arena's
room. The lock is taken on a new file that is renamed to ``holder`` once
locked: the agent never sees a ``holder`` that is not locked yet.

Best effort: a segment whose holder cannot be made (an agent too old to
name one, a directory this process may not write) is held by its lease
alone, as before. A fork (a DataLoader worker) shares the lock until it
exits, which only delays the agent's freeing.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from ..models import MemorySegment

log = logging.getLogger("tierckpt.client")


class SegmentHolds:
    """The open, locked holder files of the segments this process holds."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def hold(self, segment: MemorySegment) -> None:
        if segment.holder is None or segment.id in self._fds:
            return
        final = Path(segment.holder)
        scratch = final.with_name(f"{final.name}.{os.getpid()}.{id(self):x}")
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("memory segment %s held by its lease only: %s", segment.id, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a new file: nobody else can hold it
            os.rename(scratch, final)
        except OSError as exc:
            os.close(fd)
            scratch.unlink(missing_ok=True)
            log.debug("memory segment %s held by its lease only: %s", segment.id, exc)
            return
        self._fds[segment.id] = fd

    def let_go(self, segment_id: str) -> None:
        fd = self._fds.pop(segment_id, None)
        if fd is not None:
            os.close(fd)

    def held(self) -> list[str]:
        return list(self._fds)

    def close(self) -> None:
        for segment_id in list(self._fds):
            self.let_go(segment_id)
