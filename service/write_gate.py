"""One catalog writer at a time in this process, registrations first (SQLite).

SQLite has one write lock per database. Left to itself, a transaction that
finds it taken sleeps in SQLite's busy handler (1, 2, 5, 10 … up to 100 ms
between tries) and may lose again to a writer that arrived later: with the
worker's transactions following one another, a registration could wait
seconds for ``BEGIN IMMEDIATE``. The gate queues the agent's own writers in
the event loop instead: whoever holds it hands it straight to the next, so
nobody sleeps on a lock that is free, and an urgent holder (the registration
writer, on a trainer's critical path) goes before every waiting background
transaction (jobs, heartbeats, retention, scrub). A registration therefore
waits for at most the one background transaction already running, which is
why background transactions must stay short: no I/O, no await on other work
while the gate is held.

Who takes it: the service's SQLite driver (sqlite_driver.py) at every BEGIN
IMMEDIATE of the async engine, released when that transaction's COMMIT or
ROLLBACK ends it, before the commit's fsync (wal_sync.py); the registration
writer, urgent, around its transaction on its own thread (``gated``).

The gate orders writers of this process only; another process on the same
file (a second agent, a CLI command) still meets the busy handler, which
remains the fallback. Between the agent and its worker process
(worker_process.py) one byte of shared memory, the ``UrgentFlag``, carries
the registrations' precedence: the agent's registration writer raises it
while it waits for the write lock (db._begin_eagerly), and the worker
process's background transactions, holding their own gate, wait for it to
fall before they begin. Without it the worker's transactions, following one
another within microseconds, kept the lock nearly all the time and a
registration polling for it waited tens of milliseconds (p90 20 ms, p99
46 ms under upload load). PostgreSQL has no gate: writers there lock rows,
not the database.

Invariants: the gate is held by at most one holder; a cancelled waiter
never keeps it (a grant that raced the cancellation is passed on); release
wakes urgent waiters before background ones, each group first come first
served.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import sqlite3
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from .wal_sync import database_file

# Execution option of the engines that only read (db.create_read_sessionmaker):
# they take no write lock on SQLite, so no gate either.
READ_ONLY = "tierckpt_read_only"


class WriteGate:
    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._background: deque[asyncio.Future[None]] = deque()

    @asynccontextmanager
    async def hold(self, *, urgent: bool = False) -> AsyncIterator[None]:
        await self.acquire(urgent=urgent)
        try:
            yield
        finally:
            self.release()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in (*self._urgent, *self._background))

    async def acquire(self, *, urgent: bool = False) -> None:
        """Wait for the gate; pair with ``release`` (or use ``hold``)."""
        if not self._held and not self.waiting:
            self._held = True
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._urgent if urgent else self._background).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted as we were cancelled: pass it on
            raise

    def release(self) -> None:
        for queue in (self._urgent, self._background):
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)  # ownership moves; _held stays True
                    return
        self._held = False


class UrgentFlag:
    """One byte of memory shared by the agent and its worker process (a memfd
    the child inherits): 1 while the agent's registration writer waits for
    SQLite's write lock. One writer (the registration writer's thread), one
    reader process: a byte store needs no lock."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("tierckpt-urgent", 0)
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self._map = mmap.mmap(fd, mmap.PAGESIZE)

    def raise_(self) -> None:
        self._map[0] = 1

    def lower(self) -> None:
        self._map[0] = 0

    def raised(self) -> bool:
        return self._map[0] == 1


# The agent's flag (raised by its registration writer), or in the worker
# process the agent's flag it yields to; None: no worker process.
_URGENT: dict[str, UrgentFlag] = {}
# The longest a background transaction yields to one raised flag: the flag
# of an agent that died mid-wait must not stop the worker (it dies with the
# agent anyway, see worker_process.py).
YIELD_MAX = 1.0


def share_urgent_flag() -> UrgentFlag:
    """The agent's flag, created on first use (for its worker process)."""
    flag = _URGENT.get("raise")
    if flag is None:
        flag = _URGENT["raise"] = UrgentFlag()
    return flag


def urgent_flag_raised_by_agent(fd: int) -> None:
    """In the worker process: yield to the agent's flag (fd inherited)."""
    _URGENT["yield"] = UrgentFlag(fd)


def raising_urgent() -> UrgentFlag | None:
    return _URGENT.get("raise")


async def yield_to_agent() -> None:
    """In the worker process, before a background write transaction begins:
    wait while the agent's registration writer wants the lock."""
    flag = _URGENT.get("yield")
    if flag is None or not flag.raised():
        return
    deadline = asyncio.get_running_loop().time() + YIELD_MAX
    # Polled: the flag is another process's memory, no event tells us it fell.
    while flag.raised() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.0002)


class GaveWay(sqlite3.OperationalError):
    """A background write transaction stopped before its next statement and
    rolled back, because the agent's registration writer is waiting for the
    write lock (``give_way_if_asked``); ``db.transaction_giving_way`` runs it
    again once the registration has gone through."""


# Set while a background transaction that may give way runs (its body can
# run again from the start: db.transaction_giving_way).
_MAY_GIVE_WAY: ContextVar[bool] = ContextVar("tierckpt_may_give_way", default=False)


@contextmanager
def giving_way() -> Iterator[None]:
    """The running task's transactions inside may give way."""
    token = _MAY_GIVE_WAY.set(True)
    try:
        yield
    finally:
        _MAY_GIVE_WAY.reset(token)


def give_way_if_asked() -> None:
    """In the worker process, before each statement of a write transaction
    that may give way: raise ``GaveWay`` while the agent's flag is raised.

    The flag falls once a registration holds the lock, so the wait before
    BEGIN (``yield_to_agent``) orders only the transactions that have not
    begun: a registration arriving while one runs waited for all of it, a few
    milliseconds of the worker's Python (a niced process on CPUs the uploads
    keep busy), which made most of its lock wait under load. Rolled back
    before any statement of it commits, the transaction has changed nothing;
    the registration waits for the statement in progress and the rollback."""
    if not _MAY_GIVE_WAY.get():
        return
    flag = _URGENT.get("yield")
    if flag is not None and flag.raised():
        raise GaveWay("gave the catalog's write lock to a waiting registration")


# Per event loop: a gate's futures belong to one loop. Two loops of one
# process on the same file (a test's and an in-process app's) do not share
# a gate; SQLite's lock orders them, as it orders two processes.
_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, WriteGate]] = (
    weakref.WeakKeyDictionary()
)


def gate_for(database: str | Path) -> WriteGate:
    """The gate of one SQLite database file for the running event loop (the
    driver takes it at BEGIN IMMEDIATE: sqlite_driver.py)."""
    loop = asyncio.get_running_loop()
    gates = _GATES.get(loop)
    if gates is None:
        gates = _GATES[loop] = {}
    path = database_file(database)
    gate = gates.get(path)
    if gate is None:
        gate = gates[path] = WriteGate()
    return gate


def gate_of(bind: AsyncEngine | Engine | Any) -> WriteGate | None:
    """The gate of the SQLite database behind ``bind`` (an engine, possibly
    with execution options); None on PostgreSQL, in-memory databases and
    read-only binds."""
    sync = bind.sync_engine if isinstance(bind, AsyncEngine) else bind
    if not isinstance(sync, Engine) or sync.dialect.name != "sqlite":
        return None
    if sync.get_execution_options().get(READ_ONLY):
        return None
    database = sync.url.database
    if not database or database == ":memory:":
        return None
    return gate_for(database)


@asynccontextmanager
async def gated(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[None]:
    """Hold the gate of ``sessionmaker``'s database ahead of every waiting
    background transaction (the registration writer, whose transaction runs
    on a thread of its own); nothing on PostgreSQL. Background transactions
    take the gate in the driver (sqlite_driver.py), after yielding to the
    agent's flag in the worker process."""
    gate = gate_of(sessionmaker.kw.get("bind"))
    if gate is None:
        yield
        return
    async with gate.hold(urgent=True):
        yield
