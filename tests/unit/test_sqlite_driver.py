"""The service's SQLite driver: write transactions inline, lock and gate held
for their statements only, the commit's fsync after the lock, before return."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tierckpt.service import db, sqlite_driver
from tierckpt.service.wal_sync import WalSync, wal_sync_for
from tierckpt.service.write_gate import READ_ONLY, gate_for


async def _engine(tmp_path: Path) -> tuple[AsyncEngine, Path]:
    path = tmp_path / "catalog.db"
    engine = db.create_engine(f"sqlite+aiosqlite:///{path}")
    async with db.transaction(db.create_sessionmaker(engine)) as session:
        await session.execute(text("CREATE TABLE t (x INTEGER)"))
    return engine, path


async def test_a_write_transaction_is_not_interleaved_with_other_tasks(tmp_path: Path) -> None:
    engine, _ = await _engine(tmp_path)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    seen: list[int] = []
    async with db.transaction(db.create_sessionmaker(engine)) as session:
        seen.append(ticks)
        for n in range(20):
            await session.execute(text("INSERT INTO t VALUES (:x)"), {"x": n})
            await session.execute(text("SELECT count(*) FROM t"))
        seen.append(ticks)
    stop.set()
    await task
    # Through aiosqlite each statement waited for the loop, and the ticker ran
    # between them while the transaction held the write lock.
    assert seen[0] == seen[1]
    await engine.dispose()


async def test_the_commit_returns_after_the_fsync_with_the_gate_already_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, path = await _engine(tmp_path)
    gate = gate_for(path)
    during: list[tuple[bool, int]] = []
    real = WalSync._fsync

    def slow_fsync(self: WalSync) -> None:
        time.sleep(0.05)
        during.append((gate._held, self.fsyncs))
        real(self)

    monkeypatch.setattr(WalSync, "_fsync", slow_fsync)
    wal = wal_sync_for(path)
    before = wal.fsyncs
    async with db.transaction(db.create_sessionmaker(engine)) as session:
        await session.execute(text("INSERT INTO t VALUES (1)"))
    assert wal.fsyncs == before + 1  # the commit waited for it
    assert during and during[-1][0] is False  # nobody held the gate meanwhile
    # synchronous=NORMAL on the driver's connections: SQLite itself does not
    # fsync in COMMIT, the service does after it.
    async with engine.connect() as conn:
        level = (await conn.execute(text("PRAGMA synchronous"))).scalar()
        checkpoint = (await conn.execute(text("PRAGMA wal_autocheckpoint"))).scalar()
    assert (level, checkpoint) == (1, 0)
    await engine.dispose()


async def test_commits_that_wait_together_share_one_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, path = await _engine(tmp_path)
    real = WalSync._fsync

    def slow_fsync(self: WalSync) -> None:
        time.sleep(0.05)
        real(self)

    monkeypatch.setattr(WalSync, "_fsync", slow_fsync)
    wal = wal_sync_for(path)
    before = wal.fsyncs
    await asyncio.gather(*(_insert(engine, n) for n in range(10)))
    # The first commit's fsync runs alone; the other nine commit meanwhile
    # (the lock is free) and share the next one.
    assert wal.fsyncs - before <= 3
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 10
    await engine.dispose()


async def test_begin_waits_for_another_process_lock_without_blocking_the_loop(
    tmp_path: Path,
) -> None:
    engine, path = await _engine(tmp_path)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's transaction, in effect
    other.execute("INSERT INTO t VALUES (1)")
    task = asyncio.create_task(_insert(engine, 2))
    began = time.perf_counter()
    await asyncio.sleep(0.2)  # the loop runs on while the writer waits
    assert time.perf_counter() - began < 0.5
    assert not task.done()
    other.execute("COMMIT")
    await asyncio.wait_for(task, 10)
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT x FROM t ORDER BY x"))).scalars().all()
    assert rows == [1, 2]
    other.close()
    await engine.dispose()


async def test_a_writer_cancelled_while_waiting_for_the_lock_frees_the_gate(
    tmp_path: Path,
) -> None:
    engine, path = await _engine(tmp_path)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    task = asyncio.create_task(_insert(engine, 1))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    other.execute("ROLLBACK")
    await asyncio.wait_for(_insert(engine, 2), 10)  # the gate was not kept
    assert not gate_for(path)._held
    other.close()
    await engine.dispose()


async def test_a_rolled_back_transaction_frees_the_gate_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    engine, path = await _engine(tmp_path)
    maker = db.create_sessionmaker(engine)
    with pytest.raises(RuntimeError):
        async with db.transaction(maker) as session:
            await session.execute(text("INSERT INTO t VALUES (1)"))
            raise RuntimeError("the job failed")
    assert not gate_for(path)._held
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 0
    await engine.dispose()


async def test_reads_outside_a_write_transaction_run_off_the_loop(tmp_path: Path) -> None:
    engine, _ = await _engine(tmp_path)
    threads: set[str] = set()

    def which(_x: int) -> int:
        threads.add(threading.current_thread().name)
        return 1

    # The read-only sessions' engine (db.reading, db.create_read_sessionmaker).
    async with engine.execution_options(**{READ_ONLY: True}).connect() as conn:
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, sqlite_driver.InlineConnection)
        driver._conn.create_function("which", 1, which)
        await conn.execute(text("SELECT which(1)"))
    assert threads and all(name.startswith("tierckpt-sqlite") for name in threads)
    await engine.dispose()


def _closed(connection: sqlite3.Connection) -> bool:
    try:
        connection.in_transaction  # noqa: B018 - raises once closed
    except sqlite3.ProgrammingError:
        return True
    return False


async def test_a_cancelled_read_finishes_in_its_thread_before_the_connection_closes(
    tmp_path: Path,
) -> None:
    """SQLAlchemy terminates a connection whose query was cancelled (a
    request the client gave up on); the read goes on in its thread meanwhile.
    Closing the sqlite3 connection under it, from another thread, is a use
    of one connection by two threads at once: the close waits for the read."""
    connection = await sqlite_driver.connector(str(tmp_path / "c.db"))()
    raw = connection._conn
    entered, release = threading.Event(), threading.Event()

    def blocked() -> int:
        entered.set()
        release.wait(10)
        return 1

    raw.create_function("blocked", 0, blocked)
    cursor = connection.cursor()
    read = asyncio.create_task(cursor.execute("SELECT blocked()"))
    assert await asyncio.to_thread(entered.wait, 10)
    read.cancel()
    await asyncio.gather(read, return_exceptions=True)

    await cursor.close()
    connection.stop()
    assert not _closed(raw)  # the read is still in it
    release.set()
    for _ in range(200):
        if _closed(raw):
            break
        await asyncio.sleep(0.01)
    assert _closed(raw)


def test_the_checkpoint_thread_moves_the_wal_into_the_database(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA synchronous=NORMAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE t (x BLOB)")
    wal = WalSync(path)
    for _ in range(5):
        writer.execute("INSERT INTO t VALUES (zeroblob(100000))")
        wal.sync()
    wal._request_checkpoint()
    deadline = time.monotonic() + 10
    while wal.checkpoints == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wal.checkpoints >= 1
    busy, frames, done = writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0 and frames == done  # nothing was left to copy
    writer.close()


async def _insert(engine: AsyncEngine, x: int) -> None:
    async with db.transaction(db.create_sessionmaker(engine)) as session:
        await session.execute(text("INSERT INTO t VALUES (:x)"), {"x": x})
