"""The memory tier's arena: one directory of segments under a byte budget.

A segment is a directory ``seg-<id>/`` holding

* ``reservation.json``: run, step, rank, the files and their exact sizes,
  the bytes reserved and the lease; written (atomically) before the segment
  is handed out, so a restarted agent rebuilds its accounting from it. A
  segment reserved *ahead* (with the staging of the run's previous save, so
  that its next save needs no reservation call) has no step until it is
  staged: the step is written then (``adopt``);
* ``data/``: the files, written by the trainer in their on-disk format;
* ``holder``: while a reservation's trainer holds it, a file it keeps
  locked (holder.py): once that lock is free, the reservation is freed
  without waiting for its lease;
* ``registration.json``: the trainer's registration, written atomically once
  every file is complete. From then on the segment is *staged*: a
  checkpoint the agent must write to T0 and register, whoever dies;
* ``persisted.json``: T0 holds the bytes and the catalog the registration;
  the segment is only a cache for fast restarts and may be freed any time.

Segments are files (on a tmpfs by default), so they outlive the trainer and
the agent; the accounting is rebuilt from them at start (``open``).

Every reservation gets new files, and a freed segment's files are unlinked,
never handed to another reservation: once a file has been written and
registered, the agent never truncates or rewrites it. A process that still
reads or maps one (an upload, a restore, a user's own reader) keeps its
bytes until it lets go, whatever the agent does meanwhile: unlinking never
changes an inode's content, on any process's side. (Recycling freed files
for their pages would rewrite a file under a reader that mapped it: a
restore's tensors then silently become another checkpoint's bytes.) The new
files' pages are allocated by the trainer's checkpointer in the background
between saves (client/torch/segment_mappings.py), so a save still copies
into pages that exist. Nothing is fsynced here: a tmpfs has nothing to
sync, and a reboot loses the memory (staged checkpoints included, which the
documentation says).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..checkpoints.schemas import iso_timestamp
from ..errors import ApiError, BadInput, Conflict, NotFound
from ..whole_files import read_json, write_json_atomically
from .holder import HOLDER, holder_gone

RESERVATION = "reservation.json"
REGISTRATION = "registration.json"
PERSISTED = "persisted.json"
FAILED = "failed.json"
DATA = "data"
PREFIX = "seg-"
# Where older agents kept freed files for reuse; removed at start when found.
SPARES = "spare"


class MemoryFull(ApiError):
    """No room for the segment now; the trainer waits or writes to T0."""

    status = 507
    code = "memory_full"


@dataclass
class Segment:
    id: str
    directory: Path
    run: str
    step: int | None  # None: reserved ahead, for the run's next save (bound when staged)
    rank: int
    world_size: int
    files: dict[str, int]  # relative path -> exact size
    nbytes: int
    created: float
    lease_until: float
    registration: dict[str, Any] | None = None
    persisted: dict[str, Any] | None = None
    failed: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.directory / DATA

    @property
    def holder(self) -> Path:
        """The file its trainer holds a lock on while it holds it (holder.py)."""
        return self.directory / HOLDER

    @property
    def state(self) -> str:
        if self.failed is not None:
            return "failed"
        if self.persisted is not None:
            return "persisted"
        if self.registration is not None:
            return "staged"
        return "reserved"

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "run": self.run,
            "step": self.step,
            "rank": self.rank,
            "state": self.state,
            "bytes": self.nbytes,
            "path": str(self.data),
            "t0_path": (self.registration or {}).get("path"),
            # When T0 held the bytes (the agent's clock), as every timestamp
            # the API gives.
            "persisted_at": (
                iso_timestamp(datetime.fromtimestamp(self.persisted["at"], UTC))
                if self.persisted
                else None
            ),
            "error": self.failed,
        }


class Arena:
    """The segments of one agent and the bytes they hold against the budget.

    Used from the agent's event loop only (no lock): every method is quick
    metadata work, except ``release`` (an rmtree of tmpfs files, also quick).
    """

    def __init__(self, root: Path, budget: int, lease_seconds: float) -> None:
        self.root = root
        self.budget = budget
        self.lease_seconds = lease_seconds
        self.segments: dict[str, Segment] = {}

    @property
    def used(self) -> int:
        return sum(s.nbytes for s in self.segments.values())

    def open(self) -> None:
        """Create the directory and rebuild the accounting from the segments
        an earlier life left (staged ones are then persisted by the agent)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.rmtree(self.root / SPARES, ignore_errors=True)
        self.segments.clear()
        for entry in self.root.iterdir():
            if not entry.name.startswith(PREFIX) or not entry.is_dir():
                continue
            segment = self._load(entry)
            if segment is None:  # half-created: no reservation was handed out
                shutil.rmtree(entry, ignore_errors=True)
                continue
            self.segments[segment.id] = segment

    def _load(self, directory: Path) -> Segment | None:
        try:
            reservation = read_json(directory / RESERVATION)
        except ValueError:
            return None
        if reservation is None:
            return None
        failed = read_json(directory / FAILED)
        return Segment(
            id=reservation["id"],
            directory=directory,
            run=reservation["run"],
            step=reservation["step"],
            rank=reservation["rank"],
            world_size=reservation["world_size"],
            files=dict(reservation["files"]),
            nbytes=reservation["bytes"],
            created=reservation["created"],
            lease_until=reservation["lease_until"],
            registration=read_json(directory / REGISTRATION),
            persisted=read_json(directory / PERSISTED),
            failed=failed["error"] if failed else None,
        )

    # -- reservations ------------------------------------------------------------------

    def reserve(
        self,
        run: str,
        step: int | None,
        rank: int,
        world_size: int,
        files: dict[str, int],
        *,
        evict: bool = True,
    ) -> Segment:
        """A new segment for these files, or MemoryFull. Frees what it may
        first: expired reservations, then (``evict``) persisted
        segments, oldest first. ``step`` None: reserved ahead (``adopt``)."""
        nbytes = sum(files.values())
        if nbytes > self.budget:
            raise MemoryFull(
                f"the checkpoint ({nbytes} bytes) is larger than the whole memory tier "
                f"([memory] bytes = {self.budget}); it is written to T0 instead. Raise "
                "[memory] bytes to stage it in memory",
                code="segment_too_large",
            )
        self.reclaim_abandoned()
        self._make_room(nbytes, evict)
        now = time.time()
        segment = Segment(
            id=uuid.uuid4().hex,
            directory=Path(),
            run=run,
            step=step,
            rank=rank,
            world_size=world_size,
            files=files,
            nbytes=nbytes,
            created=now,
            lease_until=now + self.lease_seconds,
        )
        segment.directory = self.root / f"{PREFIX}{segment.id}"
        segment.directory.mkdir(mode=0o700)
        segment.data.mkdir()
        # Every file is there at its size before the trainer gets the segment:
        # a new, sparse file (its pages are allocated as the trainer writes).
        for relative, size in files.items():
            path = segment.data / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as handle:
                handle.truncate(size)
        _write_reservation(segment)
        self.segments[segment.id] = segment
        return segment

    def _make_room(self, nbytes: int, evict: bool = True) -> None:
        """Free what a reservation of ``nbytes`` needs (with ``evict``,
        persisted segments, oldest first), or MemoryFull."""
        evictable = sorted(
            (s for s in self.segments.values() if evict and s.state in ("persisted", "failed")),
            key=lambda s: s.created,
        )
        while self.used + nbytes > self.budget:
            if not evictable:
                raise MemoryFull(
                    f"the memory tier holds {self.used} of {self.budget} bytes in "
                    f"checkpoints not yet on T0; {nbytes} more do not fit. Space frees as "
                    "the agent writes them to T0 ([memory] when_full says whether saves "
                    "wait or write to T0)"
                )
            self.release(evictable.pop(0).id)
        free = self._free_bytes()
        if free is not None and free < nbytes:
            raise MemoryFull(
                f"the arena's file system ({self.root}) has {free} bytes free, "
                f"{nbytes} are needed; lower [memory] bytes or give /dev/shm more room"
            )

    def _free_bytes(self) -> int | None:
        try:
            info = os.statvfs(self.root)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize

    def reclaim_abandoned(self, now: float | None = None) -> list[str]:
        """Release reservations never registered within their lease, and
        those whose trainer held them and is gone (holder.py)."""
        now = time.time() if now is None else now
        expired = [
            s.id
            for s in self.segments.values()
            if s.state == "reserved" and (s.lease_until < now or holder_gone(s.directory))
        ]
        for segment_id in expired:
            self.release(segment_id)
        return expired

    def get(self, segment_id: str) -> Segment:
        segment = self.segments.get(segment_id)
        if segment is None:
            raise NotFound(
                f"no memory segment {segment_id!r} on this agent (released, expired, or "
                "reserved on another agent); reserve a new one",
                code="segment_not_found",
            )
        return segment

    # -- the segment's life ------------------------------------------------------------

    def adopt(self, segment: Segment, step: int) -> None:
        """A segment reserved ahead, staged as ``step``: its files are the
        next save's, whose small ones (a JSON of metrics, pickled objects)
        rarely keep their sizes, so it takes the sizes written (the same
        files by name) if the budget holds them (MemoryFull otherwise), is
        checked complete, and gets its step; the reservation is written once,
        before the registration: a restarted agent reads both back."""
        found = _regular_files(segment.data)
        if found.keys() == segment.files.keys() and found != segment.files:
            grown = sum(found.values()) - segment.nbytes
            if grown > 0 and self.used + grown > self.budget:
                raise MemoryFull(
                    f"the save's files are {grown} bytes larger than the segment reserved "
                    f"for them and the memory tier ({self.budget} bytes) has no room for that now"
                )
            segment.files, segment.nbytes = found, sum(found.values())
        self.check_complete(segment, found)
        segment.step = step
        _write_reservation(segment)

    def check_complete(self, segment: Segment, found: dict[str, int] | None = None) -> None:
        """Every reserved file is there, a regular file of exactly its size,
        and nothing else: the trainer finished writing before it registered.
        ``found``: the segment's files as just listed (``_regular_files``)."""
        found = _regular_files(segment.data) if found is None else found
        if found != segment.files:
            missing = sorted(set(segment.files) - set(found))
            extra = sorted(set(found) - set(segment.files))
            sizes = sorted(p for p in found if p in segment.files and found[p] != segment.files[p])
            raise BadInput(
                f"the segment does not hold the reserved files: missing {missing}, "
                f"unexpected {extra}, wrong size {sizes}; write every file completely "
                "before registering",
                code="segment_incomplete",
            )

    def stage(self, segment: Segment, registration: dict[str, Any]) -> None:
        """Record the registration: from now on the checkpoint must reach T0."""
        if segment.registration is not None:
            if segment.registration != registration:
                raise Conflict(
                    f"segment {segment.id} is registered already with another request",
                    code="segment_registered",
                )
            return
        write_json_atomically(segment.directory / REGISTRATION, registration)
        segment.registration = registration

    def mark_persisted(self, segment: Segment, t0_path: str) -> None:
        record = {"path": t0_path, "at": time.time()}
        write_json_atomically(segment.directory / PERSISTED, record)
        segment.persisted = record

    def mark_failed(self, segment: Segment, error: str) -> None:
        write_json_atomically(segment.directory / FAILED, {"error": error})
        segment.failed = error

    def release(self, segment_id: str) -> None:
        """Free a segment: its files are unlinked, never reused (see above)."""
        segment = self.segments.pop(segment_id, None)
        if segment is None:
            return
        shutil.rmtree(segment.directory, ignore_errors=True)

    def staged(self) -> list[Segment]:
        """Segments waiting to be written to T0, oldest first."""
        return sorted(
            (s for s in self.segments.values() if s.state == "staged"), key=lambda s: s.created
        )

    def of_run(self, run: str, states: Iterable[str]) -> list[Segment]:
        wanted = set(states)
        return [s for s in self.segments.values() if s.run == run and s.state in wanted]

    def free_older(self, segment: Segment, keep_newest: bool) -> None:
        """After ``segment`` reached T0: free the persisted segments of its run
        and rank it supersedes (and itself unless it is the one kept)."""
        same = [
            s
            for s in self.segments.values()
            if s.run == segment.run and s.rank == segment.rank and s.state == "persisted"
        ]
        newest = max(same, key=lambda s: s.step or 0, default=None)
        for other in same:
            if not keep_newest or other is not newest:
                self.release(other.id)


def _regular_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size); BadInput for
    anything but a regular file (a symlink, a FIFO)."""
    found: dict[str, int] = {}
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            relative = path.relative_to(directory).as_posix()
            if not path.is_file() or path.is_symlink():
                raise BadInput(
                    f"{relative} in the segment is not a regular file", code="invalid_segment"
                )
            found[relative] = info.st_size
    return found


def _write_reservation(segment: Segment) -> None:
    write_json_atomically(
        segment.directory / RESERVATION,
        {
            "id": segment.id,
            "run": segment.run,
            "step": segment.step,
            "rank": segment.rank,
            "world_size": segment.world_size,
            "files": segment.files,
            "bytes": segment.nbytes,
            "created": segment.created,
            "lease_until": segment.lease_until,
        },
    )
