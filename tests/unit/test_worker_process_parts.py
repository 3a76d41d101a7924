"""The parts of the worker process that need no child: the metrics the child
reports, merged into the agent's; the registration writer's eager wait for
SQLite's write lock held by another connection (another process), and the
shared flag by which the worker process's transactions yield to it."""

from __future__ import annotations

import asyncio
import gc
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tierckpt.service import db, lock_holder, write_gate
from tierckpt.service.observability import metrics


def _values(body: bytes, family: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for parsed in text_string_to_metric_families(body.decode()):
        if parsed.name == family:
            for sample in parsed.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_the_worker_process_samples_add_to_the_agents_own() -> None:
    metrics.UPLOADED_BYTES.labels("merge-test").inc(5)
    before = _values(generate_latest(metrics.REGISTRY), "tierckpt_uploaded_bytes")
    # What a child reports: its own values of the worker's families.
    reported = [
        ("tierckpt_uploaded_bytes", "tierckpt_uploaded_bytes_total", {"region": "merge-test"}, 7.0),
        ("tierckpt_uploaded_bytes", "tierckpt_uploaded_bytes_total", {"region": "only-child"}, 3.0),
        ("tierckpt_job_runs", "tierckpt_job_runs_total", {"kind": "k", "outcome": "o"}, 2.0),
    ]
    body = generate_latest(metrics.with_worker(reported))
    after = _values(body, "tierckpt_uploaded_bytes")
    key = ("tierckpt_uploaded_bytes_total", (("region", "merge-test"),))
    assert after[key] == before[key] + 7
    assert after[("tierckpt_uploaded_bytes_total", (("region", "only-child"),))] == 3
    runs = _values(body, "tierckpt_job_runs")
    assert runs[("tierckpt_job_runs_total", (("kind", "k"), ("outcome", "o")))] == 2
    # Each family once: the exposition stays valid.
    assert body.decode().count("# TYPE tierckpt_uploaded_bytes_total counter") == 1


def test_worker_samples_are_the_worker_families_without_timestamps() -> None:
    metrics.observe_job("upload", "succeeded")
    samples = metrics.worker_samples()
    families = {family for family, _name, _labels, _value in samples}
    assert "tierckpt_job_runs" in families
    assert "tierckpt_http_requests" not in families  # the agent's own, never the child's
    assert not [name for _f, name, _l, _v in samples if name.endswith("_created")]


async def test_the_eager_writer_waits_for_a_lock_another_connection_holds(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    eager = db.create_sync_engine(engine, eager_lock=True)
    assert eager is not None
    with eager.begin() as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's transaction, in effect
    other.execute("INSERT INTO t VALUES (1)")
    entered = threading.Event()

    def write() -> None:
        with eager.begin() as conn:
            entered.set()
            conn.execute(text("INSERT INTO t VALUES (2)"))

    writer = threading.Thread(target=write)
    writer.start()
    assert not entered.wait(0.2)  # still waiting for the lock, not failed
    other.execute("COMMIT")
    writer.join(30)
    assert entered.is_set()
    with eager.connect() as conn:
        assert sorted(conn.execute(text("SELECT x FROM t")).scalars()) == [1, 2]
    other.close()
    eager.dispose()
    await engine.dispose()


def test_the_eager_begin_gives_up_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "catalog.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0)
    monkeypatch.setattr(db, "LOCK_WAIT", 0.05)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        db._begin_eagerly(waiter)
    holder.execute("ROLLBACK")
    db._begin_eagerly(waiter)  # free now: taken at once
    waiter.execute("ROLLBACK")
    holder.close()
    waiter.close()


def test_the_urgent_flag_is_shared_memory() -> None:
    flag = write_gate.UrgentFlag()
    seen = write_gate.UrgentFlag(os.dup(flag.fd))  # as the worker process maps it
    assert not seen.raised()
    flag.raise_()
    assert seen.raised()
    flag.lower()
    assert not seen.raised()


async def test_background_transactions_yield_to_the_agents_raised_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flag = write_gate.UrgentFlag()
    monkeypatch.setitem(write_gate._URGENT, "yield", flag)
    # The service's engine: its driver yields before BEGIN IMMEDIATE (sqlite_driver.py).
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
    maker = db.create_sessionmaker(engine)
    entered = asyncio.Event()

    async def background() -> None:
        async with db.transaction(maker) as session:
            await session.execute(text("SELECT 1"))
            entered.set()

    flag.raise_()
    task = asyncio.create_task(background())
    for _ in range(20):
        await asyncio.sleep(0.001)
    assert not entered.is_set()  # waits while a registration wants the lock
    async with write_gate.gated(maker):  # the registration writer never yields
        pass
    flag.lower()
    await asyncio.wait_for(task, 30)
    assert entered.is_set()
    # A flag left raised (its agent died mid-wait) holds nobody for ever.
    monkeypatch.setattr(write_gate, "YIELD_MAX", 0.01)
    flag.raise_()
    await asyncio.wait_for(background(), 30)
    await engine.dispose()


async def _counting_table(tmp_path: Path) -> tuple[object, object]:
    engine = db.create_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (n INTEGER)"))
    return engine, db.create_sessionmaker(engine)


def _gave_way() -> float:
    return _values(generate_latest(metrics.REGISTRY), "tierckpt_catalog_gave_way").get(
        ("tierckpt_catalog_gave_way_total", ()), 0.0
    )


async def test_a_background_transaction_gives_way_mid_transaction_and_runs_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flag raised while a transaction that may give way runs: it rolls
    back before its next statement (nothing it wrote stays), lets the lock go,
    and runs again from the start once the flag falls."""
    flag = write_gate.UrgentFlag()
    monkeypatch.setitem(write_gate._URGENT, "yield", flag)
    engine, maker = await _counting_table(tmp_path)
    runs = 0
    before = _gave_way()

    async def body(session) -> int:  # type: ignore[no-untyped-def]
        nonlocal runs
        runs += 1
        await session.execute(text("INSERT INTO t VALUES (1)"))
        if runs == 1:
            # A registration arrives (the agent's writer raises the flag at
            # submit) while this transaction holds the lock.
            flag.raise_()
            asyncio.get_running_loop().call_later(0.05, flag.lower)
        await session.execute(text("INSERT INTO t VALUES (2)"))
        return runs

    assert await db.transaction_giving_way(maker, body) == 2
    async with maker() as session:
        rows = (await session.execute(text("SELECT n FROM t ORDER BY n"))).scalars().all()
    assert rows == [1, 2]  # the first run's insert was rolled back
    assert _gave_way() == before + 1
    await engine.dispose()


async def test_a_plain_transaction_never_gives_way_and_a_giving_one_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only ``transaction_giving_way`` gives way (its body may run twice;
    another transaction's may not), and under a flag that never falls it
    still runs to the end after ``GIVE_WAY_MAX`` tries or ``GIVE_WAY_SECONDS``."""
    flag = write_gate.UrgentFlag()
    monkeypatch.setitem(write_gate._URGENT, "yield", flag)
    monkeypatch.setattr(write_gate, "YIELD_MAX", 0.01)
    monkeypatch.setattr(db, "GIVE_WAY_SECONDS", 60.0)  # the count ends it here
    engine, maker = await _counting_table(tmp_path)

    async with db.transaction(maker) as session:
        await session.execute(text("INSERT INTO t VALUES (1)"))
        flag.raise_()
        await session.execute(text("INSERT INTO t VALUES (2)"))

    runs = 0

    async def body(session) -> None:  # type: ignore[no-untyped-def]
        nonlocal runs
        runs += 1
        await session.execute(text("INSERT INTO t VALUES (3)"))
        await session.execute(text("INSERT INTO t VALUES (4)"))

    await db.transaction_giving_way(maker, body)
    assert runs == db.GIVE_WAY_MAX + 1
    # Nor for longer than GIVE_WAY_SECONDS in all, whatever the count.
    runs = 0
    monkeypatch.setattr(db, "GIVE_WAY_SECONDS", 0.0)
    await db.transaction_giving_way(maker, body)
    assert runs <= 2
    async with maker() as session:
        rows = (await session.execute(text("SELECT n FROM t ORDER BY n"))).scalars().all()
    assert rows == [1, 2, 3, 3, 4, 4]
    flag.lower()
    await engine.dispose()


def test_the_eager_begin_raises_the_flag_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flag = write_gate.UrgentFlag()
    monkeypatch.setitem(write_gate._URGENT, "raise", flag)
    path = tmp_path / "catalog.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x INTEGER)")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0, check_same_thread=False)
    db._begin_eagerly(waiter)  # free: taken at once, no flag
    assert not flag.raised()
    waiter.execute("ROLLBACK")
    holder.execute("BEGIN IMMEDIATE")
    thread = threading.Thread(target=db._begin_eagerly, args=(waiter,))
    thread.start()
    for _ in range(30_000):
        if flag.raised():
            break
        threading.Event().wait(0.001)
    assert flag.raised()
    holder.execute("ROLLBACK")
    thread.join(30)
    assert not flag.raised()  # lowered once it holds the lock
    waiter.execute("ROLLBACK")
    holder.close()
    waiter.close()


def test_a_lock_holder_defers_the_collector_until_the_last_releases() -> None:
    assert gc.isenabled()
    first = lock_holder.holding()
    second = lock_holder.holding()  # the registration writer's, a moment together
    assert not gc.isenabled()
    lock_holder.released(first)
    assert not gc.isenabled()
    lock_holder.released(second)
    assert gc.isenabled()


def test_the_worker_lock_holder_runs_at_the_agents_niceness(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a thread niced as the worker process is: holding the lock takes the
    agent's niceness back, the release restores the worker's. Lowering a
    niceness needs CAP_SYS_NICE: without it nothing changes."""
    monkeypatch.setattr(lock_holder, "_NICE", None)
    seen: dict[str, Any] = {}

    def worker_thread() -> None:
        me = threading.get_native_id()
        agent = os.getpriority(os.PRIO_PROCESS, me)
        os.setpriority(os.PRIO_PROCESS, me, agent + 5)  # raising one is always allowed
        seen["permitted"] = lock_holder.inherit_priority(agent, agent + 5)
        held = lock_holder.holding()
        seen["holding"] = os.getpriority(os.PRIO_PROCESS, me)
        lock_holder.released(held)
        seen["released"] = os.getpriority(os.PRIO_PROCESS, me)
        seen["agent"] = agent

    thread = threading.Thread(target=worker_thread)
    thread.start()
    thread.join()
    assert seen["released"] == seen["agent"] + 5
    if seen["permitted"]:
        assert seen["holding"] == seen["agent"]
    else:
        assert seen["holding"] == seen["agent"] + 5
