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

The gate orders writers of this process only; another process on the same
file (a second agent, a CLI command) still meets the busy handler, which
remains the fallback. PostgreSQL has no gate: writers there lock rows, not
the database.

Invariants: the gate is held by at most one holder; a cancelled waiter
never keeps it (a grant that raced the cancellation is passed on); release
wakes urgent waiters before background ones, each group first come first
served.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.pool import Pool

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
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in (*self._urgent, *self._background))

    async def _acquire(self, urgent: bool) -> None:
        if not self._held and not self.waiting:
            self._held = True
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._urgent if urgent else self._background).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # granted as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        for queue in (self._urgent, self._background):
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)  # ownership moves; _held stays True
                    return
        self._held = False


_GATES: weakref.WeakKeyDictionary[Pool, WriteGate] = weakref.WeakKeyDictionary()


def gate_of(bind: AsyncEngine | Engine | Any) -> WriteGate | None:
    """The gate of the SQLite database behind ``bind`` (an engine, possibly
    with execution options); None on PostgreSQL and for read-only binds."""
    sync = bind.sync_engine if isinstance(bind, AsyncEngine) else bind
    if not isinstance(sync, Engine) or sync.dialect.name != "sqlite":
        return None
    if sync.get_execution_options().get(READ_ONLY):
        return None
    pool = sync.pool  # shared by the engine and its execution-options proxies
    gate = _GATES.get(pool)
    if gate is None:
        gate = _GATES[pool] = WriteGate()
    return gate


@asynccontextmanager
async def gated(
    sessionmaker: async_sessionmaker[AsyncSession], *, urgent: bool = False
) -> AsyncIterator[None]:
    """Hold the gate of ``sessionmaker``'s database (nothing on PostgreSQL)."""
    gate = gate_of(sessionmaker.kw.get("bind"))
    if gate is None:
        yield
        return
    async with gate.hold(urgent=urgent):
        yield
