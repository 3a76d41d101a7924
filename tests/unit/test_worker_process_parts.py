"""The parts of the worker process that need no child: the metrics the child
reports, merged into the agent's; the registration writer's eager wait for
SQLite's write lock held by another connection (another process)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tierckpt.service import db
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
