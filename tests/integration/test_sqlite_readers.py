"""On SQLite, requests that only read do not queue behind the writer."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.service.db import (
    create_engine,
    create_sync_readers,
    dispose_sync_readers,
    read_snapshot,
)
from tierckpt.service.row_reads import create_row_readers
from tierckpt.service.sqlite_driver import LOCK_WAIT


async def test_get_answers_while_another_connection_holds_the_write_lock(tmp_path: Path) -> None:
    database = tmp_path / "catalog.db"
    url = f"sqlite+aiosqlite:///{database}"
    async with running_agent(url, tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": b"w"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await agent.in_catalog("r")

        # Another process's long write transaction (a rebuild, a migration, a
        # stuck agent): it holds SQLite's write lock for a while.
        holder = sqlite3.connect(database, isolation_level=None, timeout=1)
        holder.execute("BEGIN IMMEDIATE")
        try:
            began = time.monotonic()
            answer = await asyncio.wait_for(agent.http.get("/v1/runs/r/checkpoints/1"), 10)
            listed = await asyncio.wait_for(agent.http.get("/v1/runs/r/checkpoints"), 10)
            elapsed = time.monotonic() - began
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert answer.status_code == 200 and answer.json()["step"] == 1
        assert listed.status_code == 200
        # A reader that took the write lock would wait for the holder (the
        # busy timeout is 30 s); a snapshot reader answers at once.
        assert elapsed < 5, f"GET waited {elapsed:.1f}s behind the writer"

        # Writes still take the lock and still succeed once it is free.
        ckpt2 = write_checkpoint(agent.ssd / "s2", {"w.bin": b"v"})
        assert (await agent.register("r", 2, ckpt2)).status_code == 202


def _busy() -> OperationalError:
    """What SQLite answers a reader at a busy moment (busy_timeout 0)."""
    return OperationalError("SELECT", {}, sqlite3.OperationalError("database is locked"))


def _broken() -> OperationalError:
    """Any other error of a read: not to be run again."""
    return OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: x"))


def _where(loop_thread: int) -> str:
    return "loop" if threading.get_ident() == loop_thread else "thread"


async def test_detail_reads_on_the_event_loop_and_in_a_thread_when_sqlite_is_busy(
    tmp_path: Path,
) -> None:
    """db.read_snapshot, as the detail view uses it: on the loop's own thread with a
    connection that never waits for a lock; when SQLite answers busy there,
    the same read again in a thread of the readers that wait."""
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}")
    inline = create_sync_readers(engine, inline=True)
    threaded = create_sync_readers(engine)
    assert inline is not None and threaded is not None
    loop_thread = threading.get_ident()
    ran_in: list[str] = []

    def timeout_of(session: Session) -> int:
        ran_in.append(_where(loop_thread))
        return int(session.execute(text("PRAGMA busy_timeout")).scalar_one())

    def busy_on_the_loop(session: Session) -> int:
        if _where(loop_thread) == "loop":
            raise _busy()
        return timeout_of(session)

    def broken(session: Session) -> int:
        raise _broken()

    try:
        assert await read_snapshot(inline, threaded, timeout_of) == 0
        assert ran_in == ["loop"]
        assert await read_snapshot(inline, threaded, busy_on_the_loop) == LOCK_WAIT * 1000
        assert ran_in == ["loop", "thread"]
        with pytest.raises(OperationalError, match="no such table"):
            await read_snapshot(inline, threaded, broken)  # not busy: not run again
        assert await read_snapshot(None, threaded, timeout_of) == LOCK_WAIT * 1000
        assert ran_in[-1] == "thread"
    finally:
        dispose_sync_readers(inline)
        dispose_sync_readers(threaded)
        await engine.dispose()


async def test_row_reads_keep_one_connection_on_the_loop_and_see_each_commit(
    tmp_path: Path,
) -> None:
    """row_reads.RowReaders, as `latest` and the register's check use it: on
    the loop's own thread, on one connection kept between reads, each read a
    snapshot of its own (a commit between two reads is seen by the second:
    no transaction stays open); when SQLite answers busy there, the same
    read in a thread of a pool that waits; after any other error the next
    read checks a connection out again (the pool replaces one the error
    invalidated)."""
    database = tmp_path / "catalog.db"
    engine = create_engine(f"sqlite+aiosqlite:///{database}")
    threaded = create_sync_readers(engine)
    assert threaded is not None
    rows = create_row_readers(engine, engine, threaded.kw["bind"])
    writer = sqlite3.connect(database, isolation_level=None)
    writer.execute("CREATE TABLE t (n INTEGER)")
    loop_thread = threading.get_ident()
    # The connections themselves, not their id(): one dropped after an error
    # may be collected and its id() given to the next.
    seen: list[tuple[str, Connection]] = []

    def count(connection: Connection) -> int:
        seen.append((_where(loop_thread), connection))
        return int(connection.execute(text("SELECT count(*) FROM t")).scalar_one())

    def busy_on_the_loop(connection: Connection) -> int:
        if _where(loop_thread) == "loop":
            raise _busy()
        return count(connection)

    def broken(connection: Connection) -> int:
        raise _broken()

    def timeout_of(connection: Connection) -> int:
        return int(connection.execute(text("PRAGMA busy_timeout")).scalar_one())

    try:
        assert await rows.read(count) == 0
        writer.execute("INSERT INTO t VALUES (1)")
        assert await rows.read(count) == 1  # a fresh snapshot
        assert [where for where, _ in seen] == ["loop", "loop"]
        assert seen[0][1] is seen[1][1]  # the same connection, kept
        assert await rows.read(timeout_of) == 0  # the loop's never waits
        # A write lock held elsewhere does not hold up a reader (WAL).
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO t VALUES (2)")
        assert await rows.read(count) == 1
        writer.execute("COMMIT")
        assert await rows.read(busy_on_the_loop) == 2
        assert seen[-1][0] == "thread"
        with pytest.raises(OperationalError, match="no such table"):
            await rows.read(broken)  # not busy: not run again
        assert await rows.read(count) == 2
        assert seen[-1][0] == "loop" and seen[-1][1] is not seen[0][1]  # checked out again
    finally:
        writer.close()
        rows.dispose()
        dispose_sync_readers(threaded)
        await engine.dispose()
