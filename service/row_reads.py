"""Whole reads of catalog rows on the hot path (`latest`, the register's
check), without an ORM session.

The reads behind `latest` and a registration's check fetch a few indexed
rows as plain tuples; on SQLite they run on the event loop
(db.read_snapshot explains why). Around those rows, a session's machinery
cost more than the rows themselves: a Session made, a connection checked
out of the pool and reset on its return, the transaction opened through the
ORM's state machine (benchmarks/README.md, "Issue 16 on a fourteenth
machine"). Here a read is a function of a plain ``Connection``:

* SQLite: the event loop keeps one read-only connection of its own open
  (``LoopConnection``; used only on the loop, one read at a time), and each
  read is one deferred transaction on it: one snapshot, no write lock. A
  WAL reader waits for nobody except in rare moments, when SQLite answers
  busy at once; that read then runs in a thread on a pooled connection,
  which may wait (as read_snapshot's sessions do).
* PostgreSQL: a connection of the read pool (autocommit: the one statement
  is its own snapshot), through ``AsyncConnection.run_sync``.

The detail view reads ORM entities on SQLite, in a session
(db.read_snapshot); on PostgreSQL it is one statement here too
(checkpoints/detail_in_one.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from .db import create_sync_engine
from .sqlite_driver import busy
from .write_gate import READ_ONLY

T = TypeVar("T")


class LoopConnection:
    """The event loop's own read-only SQLite connection, kept checked out
    between reads (checked out again after an error)."""

    def __init__(self, engine: Engine) -> None:
        # ``engine``: db.create_sync_engine's (never_wait), with the
        # read-only option, so each read's BEGIN takes no lock.
        self._engine = engine
        self._connection: Connection | None = None

    def read(self, read: Callable[..., T], *args: Any) -> T:
        connection = self._connection
        if connection is None or connection.closed or connection.invalidated:
            connection = self._connection = self._engine.connect()
        try:
            with connection.begin():
                return read(connection, *args)
        except DBAPIError:
            # Whatever went wrong, the next read checks a connection out
            # again (the pool replaces one the error invalidated).
            self.close()
            raise

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def dispose(self) -> None:
        self.close()
        self._engine.dispose()


def _in_thread(engine: Engine, read: Callable[..., T], *args: Any) -> T:
    with engine.connect() as connection, connection.begin():
        return read(connection, *args)


@dataclass
class RowReaders:
    """Where row reads run: on SQLite ``loop`` (``threaded``, the pooled
    read-only engine of db.create_sync_readers, when the loop's connection
    meets a busy moment), else ``pool``, the read engine (PostgreSQL's
    autocommit pool)."""

    pool: AsyncEngine
    loop: LoopConnection | None = None
    threaded: Engine | None = None

    async def read(self, read: Callable[..., T], *args: Any) -> T:
        """``read(connection, *args)``, in one snapshot."""
        if self.loop is not None and self.threaded is not None:
            try:
                return self.loop.read(read, *args)
            except OperationalError as exc:
                if not isinstance(exc.orig, sqlite3.OperationalError) or not busy(exc.orig):
                    raise
            return await asyncio.to_thread(_in_thread, self.threaded, read, *args)
        return await _read_with_retry(self.pool, read, *args)

    def dispose(self) -> None:
        """Close the loop's connection (``pool`` and ``threaded`` are their
        makers' to close)."""
        if self.loop is not None:
            self.loop.dispose()


def create_row_readers(
    engine: AsyncEngine, pool: AsyncEngine, threaded: Engine | None
) -> RowReaders:
    """``engine``: the catalog's; ``pool``: its read engine
    (db.create_read_sessionmaker's); ``threaded``: the engine of its
    threaded sync readers (db.create_sync_readers'), None without them."""
    loop = create_sync_engine(engine, pool_size=1, never_wait=True)
    if loop is None or threaded is None:  # PostgreSQL, or SQLite in memory
        return RowReaders(pool)
    return RowReaders(pool, LoopConnection(loop.execution_options(**{READ_ONLY: True})), threaded)


async def _read_with_retry(pool: AsyncEngine, read: Callable[..., T], *args: Any) -> T:
    """PostgreSQL: the read, once more on a connection that turned out dead
    (db._ping_when_idle hands out recently used ones without a ping; the
    failure invalidated the pool, so the second try gets a fresh one)."""
    for attempt in (1, 2):
        try:
            async with pool.connect() as connection:
                return await connection.run_sync(read, *args)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
    raise AssertionError("unreachable")
