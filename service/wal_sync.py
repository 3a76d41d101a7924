"""A commit's fsync after SQLite's write lock is free (WAL mode).

At ``synchronous=FULL`` SQLite fsyncs the WAL inside COMMIT, while the
transaction still holds the database's one write lock: every writer, the
registrations first, queued behind another's fsync (milliseconds each on a
disk the uploads keep busy). The service's own connections run at
``synchronous=NORMAL`` instead, where COMMIT only hands the WAL's new frames
to the page cache and releases the lock, and then wait here for an fsync of
the WAL before they return. A commit that returned is therefore on disk, as
at FULL (a power loss keeps it), but nobody holds the lock meanwhile.

One fsync covers every commit that finished before it started (group
commit): a commit arriving while one runs waits for the next.

The WAL's frames are checkpointed into the database here too. Autocheckpoint
is off on the service's connections: it runs inside the COMMIT that crosses
the threshold, which would be on the event loop (sqlite_driver.py) or in a
trainer's registration. A thread of this module runs a PASSIVE checkpoint
instead when enough commits have gone by; it takes no lock that writers
wait for.

Why fsyncing the WAL file suffices: the frames a COMMIT wrote are in that
file, and SQLite's recovery replays exactly the frames up to the last commit
whose checksums hold. The directory entry of a new WAL file is fsynced too,
once (at FULL, SQLite does it at the file's first sync). If the WAL was
deleted meanwhile (the last connection closed), its frames were checkpointed
and the database fsynced: there is nothing left to sync.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tierckpt.catalog")

# Commits between two checkpoints (SQLite's default autocheckpoint is about
# 1,000 pages, a few hundred of the catalog's transactions).
CHECKPOINT_EVERY = 200
# WAL size kept after a checkpoint resets it (journal_size_limit).
WAL_SIZE_LIMIT = 64 * 1024 * 1024

Done = Callable[[BaseException | None], None]


class WalSync:
    """The fsyncs and checkpoints of one SQLite database, for this process."""

    def __init__(self, database: Path) -> None:
        self.database = database
        self.wal = Path(f"{database}-wal")
        self._cond = threading.Condition()
        self._waiting: list[Done] = []
        self._commits = 0
        self._thread: threading.Thread | None = None
        self._checkpointer: threading.Thread | None = None
        self._checkpoint_due = threading.Event()
        self._synced_inode: int | None = None
        self.fsyncs = 0  # statistics, for tests
        self.checkpoints = 0

    # -- committers ---------------------------------------------------------

    def sync(self) -> None:
        """After a COMMIT, in a thread of the caller's (the registration
        writer's): the fsync right there, without a handoff to this
        module's thread and the wake-up it would cost."""
        self._fsync()
        self._count_commits(1)

    def sync_soon(self, finished: Done) -> None:
        """After a COMMIT answered before its fsync (``[catalog] register_ack
        = "committed"``): the fsync on this module's thread, with every
        commit waiting there; ``finished`` hears how it went, on that thread."""
        self._enqueue(finished)

    async def synced(self) -> None:
        """After a COMMIT, on the event loop: returns once the WAL is on disk."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        def finished(error: BaseException | None) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, error)

        self._enqueue(finished)
        await future

    def _enqueue(self, finished: Done) -> None:
        with self._cond:
            self._waiting.append(finished)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="tierckpt-wal-sync", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    # -- the fsync thread ---------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                taken, self._waiting = self._waiting, []
            error: BaseException | None = None
            try:
                self._fsync()
            except BaseException as exc:  # every waiter hears of it
                error = exc
            for finished in taken:
                finished(error)
            self._count_commits(len(taken))

    def _fsync(self) -> None:
        try:
            fd = os.open(self.wal, os.O_RDONLY)
        except FileNotFoundError:
            return  # checkpointed and removed: the database file holds it, synced
        try:
            # fdatasync, as SQLite itself syncs the WAL: the frames and the
            # file's size, not its mtime, whose journal commit would make
            # every sync of a WAL reused in place cost one more write.
            os.fdatasync(fd)
            inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self.fsyncs += 1
        if inode != self._synced_inode:
            # A new WAL file: its name must survive a power loss too.
            directory = os.open(self.wal.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            self._synced_inode = inode

    # -- checkpoints --------------------------------------------------------

    def _count_commits(self, synced: int) -> None:
        """``synced`` more commits are on disk; every ``CHECKPOINT_EVERY``,
        a checkpoint."""
        with self._cond:
            self._commits += synced
            if self._commits < CHECKPOINT_EVERY:
                return
        self._request_checkpoint()

    def _request_checkpoint(self) -> None:
        with self._cond:
            self._commits = 0
            if self._checkpointer is None or not self._checkpointer.is_alive():
                self._checkpointer = threading.Thread(
                    target=self._checkpoints, name="tierckpt-wal-checkpoint", daemon=True
                )
                self._checkpointer.start()
        self._checkpoint_due.set()

    def _checkpoints(self) -> None:
        connection: sqlite3.Connection | None = None
        while True:
            self._checkpoint_due.wait()
            self._checkpoint_due.clear()
            try:
                if connection is None:
                    connection = sqlite3.connect(
                        self.database, isolation_level=None, check_same_thread=False, timeout=0
                    )
                    connection.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
                # PASSIVE: copies what no reader still needs, never waits for
                # a lock, never makes a writer wait.
                connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.checkpoints += 1
            except sqlite3.Error as exc:
                log.warning("catalog checkpoint failed (retried later): %s", exc)
                if connection is not None:
                    connection.close()
                connection = None


_SYNCS: dict[Path, WalSync] = {}
_SYNCS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def database_file(database: str | Path) -> Path:
    """``database`` resolved, once per spelling: what names one SQLite file
    for this process (its ``WalSync``, its write gates), looked up at every
    write transaction."""
    return Path(database).resolve()


def wal_sync_for(database: str | Path) -> WalSync:
    """The process's ``WalSync`` of ``database`` (one per file)."""
    path = database_file(database)
    with _SYNCS_LOCK:
        found = _SYNCS.get(path)
        if found is None:
            found = _SYNCS[path] = WalSync(path)
        return found
