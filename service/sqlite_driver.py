"""The service's SQLite connections: write transactions run inline on the event loop.

Through aiosqlite every statement is a trip to the connection's thread and
back to the event loop. Under upload load the loop is busy (the worker's
request signing and parsing, the part pipeline) and each trip back waits
for it: a background write transaction of five statements held SQLite's one
write lock, and the agent's write gate, for tens of milliseconds, and a
trainer's registration waited for all of it (issue: register p99 under
upload load). A statement of the catalog's own, on local SQLite, takes
microseconds: less than one such trip.

So a connection made here runs the statements of a write transaction (from
BEGIN IMMEDIATE to COMMIT or ROLLBACK) inline, on the event loop, without
awaiting anything: the transaction cannot be interleaved, and holds the
lock for its statements' own time. What could take long stays off the loop:

* BEGIN IMMEDIATE first waits, asynchronously, for this process's write gate
  (write_gate.py: the registrations go first), then for SQLite's lock,
  tried again after short sleeps while another process (the worker process,
  a CLI command) holds it, never in SQLite's blocking busy handler;
* COMMIT runs at ``synchronous=NORMAL``: it writes the WAL to the page cache
  and releases the lock; the connection then waits for the fsync on another
  thread (wal_sync.py) before the commit returns, so what committed is on
  disk as at FULL;
* statements outside a write transaction (reads, PRAGMAs, deferred BEGIN of
  the read-only sessions) run on a small thread pool of their own, as
  aiosqlite ran them, since a read may scan a lot;
* a background transaction of the worker process may give the lock up to
  a waiting registration before any of its statements (write_gate.py,
  ``give_way_if_asked``), rolled back and run again;
* while it holds the lock, no garbage collection, and in the worker process
  the agent's niceness (lock_holder.py);
* autocheckpoint is off (a checkpoint inside COMMIT would run on the loop):
  wal_sync.py checkpoints on its own thread.

One call at a time on a connection, whichever thread makes it (its
``_using`` lock), as aiosqlite's one thread per connection gave: a read
whose awaiting task was cancelled goes on in its thread, and SQLAlchemy
then rolls back, closes or terminates that connection; the sqlite3 module
does not take two threads in one connection (or one cursor) at once.

It is an aiosqlite stand-in for SQLAlchemy's aiosqlite dialect (the
``async_creator`` of ``create_async_engine``): URLs stay ``sqlite+aiosqlite://``.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from . import lock_holder
from .wal_sync import WalSync, wal_sync_for
from .write_gate import WriteGate, gate_for, give_way_if_asked, yield_to_agent

T = TypeVar("T")

# How long BEGIN IMMEDIATE waits for another process's write lock before it
# fails as "database is locked" (SQLite's busy_timeout of the other engines),
# and its pauses between two tries.
LOCK_WAIT = 30.0
_PAUSES = (0.0002, 0.0005, 0.001, 0.002, 0.005)
# Threads for the statements that run off the loop (reads): a few requests'
# reads at once, apart from the default executor the uploads' hashing fills.
_READ_THREADS = 4
_READS: ThreadPoolExecutor | None = None


def _reads() -> ThreadPoolExecutor:
    global _READS
    if _READS is None:
        _READS = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="tierckpt-sqlite")
    return _READS


def busy(exc: sqlite3.OperationalError) -> bool:
    """SQLite answered that another connection holds what was asked for."""
    text = str(exc)
    return "locked" in text or "busy" in text


def connector(database: str, *, timeout: float = LOCK_WAIT) -> Callable[[], Any]:
    """The ``async_creator`` of an engine on ``database``."""
    path = Path(database)

    async def connect() -> InlineConnection:
        def opened() -> sqlite3.Connection:
            # The PRAGMAs (synchronous=NORMAL, no autocheckpoint, ...) are
            # db._sqlite_transactions', on every connection of the engine.
            return sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, timeout=timeout
            )

        loop = asyncio.get_running_loop()
        connection = await loop.run_in_executor(_reads(), opened)
        return InlineConnection(connection, path, wal_sync_for(path), timeout)

    return connect


class _Immediately:
    """SQLAlchemy's adapter sets isolation_level through aiosqlite's queue:
    ``_tx.put_nowait((future, function))``. Here it runs at once."""

    def __init__(self, using: threading.Lock) -> None:
        self._using = using

    def put_nowait(self, item: tuple[asyncio.Future[Any], Callable[[], Any]]) -> None:
        future, function = item
        try:
            with self._using:
                future.set_result(function())
        except Exception as exc:
            future.set_exception(exc)


class InlineConnection:
    """What SQLAlchemy's aiosqlite adapter uses of an ``aiosqlite.Connection``."""

    def __init__(
        self, connection: sqlite3.Connection, path: Path, wal: WalSync, timeout: float
    ) -> None:
        self._conn = connection
        self._connection: sqlite3.Connection | None = connection
        # Held by whichever thread calls into the connection (module docstring).
        self._using = threading.Lock()
        self._tx = _Immediately(self._using)
        self._path = path
        self._gate: WriteGate | None = None  # held: the running loop's gate of this file
        self._wal = wal
        self._timeout = timeout
        self._writing = False  # in a write transaction: holds the gate and the lock
        self._held: lock_holder.Held | None = None  # what lock_holder.holding changed

    # -- where a statement runs ---------------------------------------------

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        if self._writing:
            try:
                return self._alone(function, *args)
            finally:
                self._after()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_reads(), self._alone, function, *args)

    def _alone(self, function: Callable[..., T], *args: Any) -> T:
        """``function`` with no other thread in the connection. On the loop
        the lock is free (the connection's last call returned there), except
        after a cancelled read still running in its thread: then the loop
        waits for that read, whose end it needs anyway."""
        with self._using:
            return function(*args)

    def _soon(self, function: Callable[[], Any]) -> None:
        """``function`` now if no thread is in the connection, else on the
        read pool once the one there is done (a sync caller must not wait)."""
        if self._using.acquire(blocking=False):
            try:
                function()
            finally:
                self._using.release()
        else:
            _reads().submit(self._alone, function)

    def _after(self) -> None:
        """The write transaction ended (COMMIT or ROLLBACK, also as SQL, or
        an error that rolled it back): the gate goes to the next writer."""
        if self._writing and not self._conn.in_transaction:
            self._release()

    def _release(self) -> None:
        self._writing = False
        held, self._held = self._held, None
        if held is not None:
            lock_holder.released(held)
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()

    async def _begin_immediate(self, cursor: sqlite3.Cursor, sql: str) -> sqlite3.Cursor:
        gate = gate_for(self._path)
        await gate.acquire()
        self._gate = gate
        try:
            await yield_to_agent()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._timeout
            tries = 0
            # Never SQLite's busy handler here: it would sleep on the loop.
            self._alone(self._conn.execute, "PRAGMA busy_timeout=0")
            try:
                while True:
                    try:
                        self._alone(cursor.execute, sql)
                        break
                    except sqlite3.OperationalError as exc:
                        if not busy(exc) or loop.time() > deadline:
                            raise
                    await asyncio.sleep(_PAUSES[min(tries, len(_PAUSES) - 1)])
                    tries += 1
            finally:
                wait = f"PRAGMA busy_timeout={int(self._timeout * 1000)}"
                self._alone(self._conn.execute, wait)
        except BaseException:
            if self._conn.in_transaction:
                self._alone(self._conn.rollback)
            self._release()
            raise
        self._writing = True
        self._held = lock_holder.holding()
        return cursor

    # -- the aiosqlite.Connection interface ---------------------------------

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    def cursor(self) -> InlineCursor:
        return InlineCursor(self, self._alone(self._conn.cursor))

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> InlineCursor:
        cursor = self.cursor()
        await cursor.execute(sql, parameters)
        return cursor

    async def commit(self) -> None:
        wrote = self._writing
        await self._run(self._conn.commit)
        if wrote and not self._writing:
            await self._wal.synced()

    async def rollback(self) -> None:
        await self._run(self._conn.rollback)

    async def create_function(self, *args: Any, **kwargs: Any) -> None:
        self._conn.create_function(*args, **kwargs)

    async def close(self) -> None:
        if self._connection is None:
            return
        self._connection = None
        self._release()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(_reads(), self._alone, self._conn.close)

    def stop(self) -> None:
        """Forced close (SQLAlchemy's terminate): at once, or after the call
        a cancelled task left running in the connection."""
        self._connection = None
        self._release()
        self._soon(self._conn.close)


class InlineCursor:
    """What the adapter uses of an ``aiosqlite.Cursor``."""

    def __init__(self, owner: InlineConnection, cursor: sqlite3.Cursor) -> None:
        self._owner = owner
        self._cursor = cursor

    async def __aenter__(self) -> InlineCursor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> InlineCursor:
        if sql.lstrip()[:15].upper() == "BEGIN IMMEDIATE":
            await self._owner._begin_immediate(self._cursor, sql)
            return self
        if self._owner._writing:
            give_way_if_asked()
        if parameters is None:
            await self._owner._run(self._cursor.execute, sql)
        else:
            await self._owner._run(self._cursor.execute, sql, parameters)
        return self

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any]]) -> InlineCursor:
        if self._owner._writing:
            give_way_if_asked()
        await self._owner._run(self._cursor.executemany, sql, parameters)
        return self

    async def fetchone(self) -> Any:
        return await self._owner._run(self._cursor.fetchone)

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        if size is None:
            return await self._owner._run(self._cursor.fetchmany)
        return await self._owner._run(self._cursor.fetchmany, size)

    async def fetchall(self) -> list[Any]:
        return await self._owner._run(self._cursor.fetchall)

    async def close(self) -> None:
        self._owner._soon(self._cursor.close)

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value
