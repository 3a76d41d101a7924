"""Group commit of registrations (service/checkpoints/batching.py), on SQLite
and PostgreSQL: many concurrent registrations share one transaction, and
still each one is answered on its own merits.

The batching is driven two ways: through HTTP with many requests at once (the
real path), and through ``RegistrationBatcher.submit`` gathered in one loop
iteration, which puts every submitted registration in the same batch for sure.
The agents answer at the commit (``register_ack = "committed"``), so that a
request's answer is its batch's; by default a new checkpoint's registration
reaches the same writer just behind its answer (inbox.py,
test_register_inbox.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from devsupport.agent import AT_COMMIT, Agent, running_agent, write_checkpoint
from devsupport.tcpproxy import TcpProxy
from tierckpt.service.checkpoints.batch_write import Outcome
from tierckpt.service.checkpoints.scan import ScannedShard
from tierckpt.service.checkpoints.schemas import RegisterRequest
from tierckpt.service.checkpoints.service import submit_registration
from tierckpt.service.errors import ApiError
from tierckpt.service.models import Checkpoint, File, Job, Replica, Shard
from tierckpt.service.wal_sync import wal_sync_for


async def count(agent: Agent, model: Any) -> int:
    async with agent.resources.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(model)) or 0)


def request(agent: Agent, run: str, step: int, path: Path, **extra: Any) -> RegisterRequest:
    return RegisterRequest.model_validate({"run": run, "step": step, "path": str(path), **extra})


async def submit_together(agent: Agent, requests: list[RegisterRequest]) -> list[Any]:
    """Submit in one loop iteration: one batch (checked by the caller)."""
    return await asyncio.gather(
        *(submit_registration(agent.resources, agent.process.registrations, r) for r in requests),
        return_exceptions=True,
    )


async def test_many_concurrent_registrations_are_all_committed(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        paths = [
            write_checkpoint(agent.ssd / f"s{i}", {"w.bin": b"w" * i, "meta.json": b"{}"})
            for i in range(120)
        ]
        answers = await asyncio.gather(
            *(
                agent.register(f"run-{i % 3}", i, path, metrics={"loss": i / 10})
                for i, path in enumerate(paths)
            )
        )
        assert [a.status_code for a in answers] == [202] * len(paths), [
            a.text for a in answers if a.status_code != 202
        ][:3]
        batcher = agent.process.registrations
        assert batcher.largest_batch > 1, "the registrations were not batched"
        assert batcher.batches < len(paths)

        # The answer is the committed record, identical to a read-back.
        for i in (0, 57, 119):
            body = answers[i].json()
            assert (body["run"], body["step"], body["state"]) == (f"run-{i % 3}", i, "registered")
            assert body["file_count"] == 2 and body["total_bytes"] == i + 2
            assert body["metrics"] == {"loss": i / 10}
            detail = await agent.http.get(f"/v1/runs/run-{i % 3}/checkpoints/{i}")
            assert detail.status_code == 200
            stored = detail.json()
            for key in ("created_at", "shards", "replicas", "total_bytes", "priority", "children"):
                assert stored[key] == body[key], key
        assert await count(agent, Checkpoint) == len(paths)
        assert await count(agent, Shard) == len(paths)
        assert await count(agent, File) == 2 * len(paths)
        assert await count(agent, Replica) == len(paths)
        assert await count(agent, Job) == len(paths)
        runs = (await agent.http.get("/v1/runs")).json()
        assert runs["total"] == 3


async def test_one_bad_registration_does_not_fail_its_batch(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        ssd = agent.ssd
        old = write_checkpoint(ssd / "old", {"w.bin": b"old"})
        assert (await agent.register("r", 1, old)).status_code == 202
        assert (await agent.register("r", 2, old, world_size=2)).status_code == 202
        good = [write_checkpoint(ssd / f"g{i}", {"w.bin": b"good"}) for i in range(10)]
        changed = write_checkpoint(ssd / "changed", {"w.bin": b"new content"})

        batcher = agent.process.registrations
        before = batcher.batches
        results = await submit_together(
            agent,
            [
                *(request(agent, "r", 10 + i, p) for i, p in enumerate(good[:5])),
                request(agent, "r", 1, changed),  # 409: different content
                request(agent, "r", 2, changed, rank=1, world_size=4),  # 409: world size
                *(request(agent, "r", 20 + i, p) for i, p in enumerate(good[5:])),
            ],
        )
        assert batcher.batches == before + 1, "expected a single batch"
        errors = [r for r in results if isinstance(r, BaseException)]
        assert [(type(e), getattr(e, "status", None)) for e in errors] == [
            (type(errors[0]), 409),
            (type(errors[1]), 409),
        ]
        assert "different content" in str(errors[0]) and "world_size" in str(errors[1])
        created = [r for r in results if isinstance(r, Outcome)]
        assert len(created) == 10 and all(o.created for o in created)
        for step in [*range(10, 15), *range(20, 25)]:
            detail = await agent.http.get(f"/v1/runs/r/checkpoints/{step}")
            assert detail.status_code == 200, step
        # The refused ones changed nothing.
        first = (await agent.http.get("/v1/runs/r/checkpoints/1")).json()
        assert first["total_bytes"] == 3 and len(first["shards"]) == 1
        second = (await agent.http.get("/v1/runs/r/checkpoints/2")).json()
        assert second["world_size"] == 2 and len(second["shards"]) == 1


async def test_a_statement_the_catalog_refuses_fails_only_that_registration(
    catalog_url: str, tmp_path: Path
) -> None:
    """A registration whose rows the database itself refuses (here: the same
    file listed twice, against UNIQUE(shard, path)) rolls the batch back; the
    batch is then written one by one and only that registration fails."""
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        paths = [write_checkpoint(agent.ssd / f"s{i}", {"w.bin": b"x"}) for i in range(6)]
        batcher = agent.process.registrations
        real_submit = batcher.submit

        async def tampering_submit(registration: Any) -> Outcome:
            if registration.request.step == 3:
                scanned = registration.scanned
                doubled = ScannedShard(
                    directory=scanned.directory,
                    files=[*scanned.files, *scanned.files],
                    is_directory=scanned.is_directory,
                )
                registration = dataclasses.replace(registration, scanned=doubled)
            return await real_submit(registration)

        batcher.submit = tampering_submit  # type: ignore[method-assign]
        try:
            results = await submit_together(
                agent, [request(agent, "r", i, p) for i, p in enumerate(paths)]
            )
        finally:
            batcher.submit = real_submit  # type: ignore[method-assign]
        failed = results[3]
        assert isinstance(failed, Exception) and not isinstance(failed, ApiError), failed
        assert all(isinstance(r, Outcome) and r.created for i, r in enumerate(results) if i != 3)
        assert (await agent.http.get("/v1/runs/r/checkpoints/3")).status_code == 404
        for step in (0, 1, 2, 4, 5):
            assert (await agent.http.get(f"/v1/runs/r/checkpoints/{step}")).status_code == 200
        assert await count(agent, Checkpoint) == 5
        assert await count(agent, Job) == 5
        # The step can be registered properly afterwards.
        assert (await agent.register("r", 3, paths[3])).status_code == 202


async def test_idempotent_and_multi_rank_within_one_batch(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        ckpt = write_checkpoint(agent.ssd / "a", {"w.bin": b"a"})
        other = write_checkpoint(agent.ssd / "b", {"w.bin": b"bb"})
        ranks = [
            write_checkpoint(agent.ssd / f"rank{i}", {"w.bin": b"r" * (i + 1)}) for i in range(4)
        ]
        batcher = agent.process.registrations
        before = batcher.batches
        results = await submit_together(
            agent,
            [
                request(agent, "r", 1, ckpt),
                request(agent, "r", 1, ckpt, priority="urgent"),  # same content: 200, promotes
                request(agent, "r", 1, other),  # different content, same rank: 409
                *(request(agent, "r", 2, p, rank=i, world_size=4) for i, p in enumerate(ranks)),
            ],
        )
        assert batcher.batches == before + 1
        first, again, conflict, *shards = results
        assert isinstance(first, Outcome) and first.created
        assert isinstance(again, Outcome) and not again.created
        assert isinstance(conflict, ApiError) and conflict.status == 409
        assert all(isinstance(s, Outcome) and s.created for s in shards)

        detail = (await agent.http.get("/v1/runs/r/checkpoints/1")).json()
        assert detail["priority"] == "urgent" and detail["file_count"] == 1
        assert [j["kind"] for j in detail["jobs"]] == ["upload"]
        multi = (await agent.http.get("/v1/runs/r/checkpoints/2")).json()
        assert sorted(s["rank"] for s in multi["shards"]) == [0, 1, 2, 3]
        assert multi["total_bytes"] == 1 + 2 + 3 + 4 and multi["file_count"] == 4
        async with agent.resources.sessionmaker() as session:
            priorities = list(await session.scalars(select(Job.priority).order_by(Job.id)))
        assert priorities[0] == 100  # the urgent re-register promoted the queued upload

        # Over HTTP afterwards: the same answers (200 with the record, 409).
        same = await agent.register("r", 1, ckpt)
        assert same.status_code == 200 and same.json()["priority"] == "urgent"
        assert (await agent.register("r", 1, other)).status_code == 409
        rank = await agent.register("r", 2, ranks[1], rank=1, world_size=4)
        assert rank.status_code == 200 and len(rank.json()["shards"]) == 4


async def test_another_rank_of_an_existing_checkpoint_over_http(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        ranks = [write_checkpoint(agent.ssd / f"r{i}", {"w.bin": b"x" * 10}) for i in range(3)]
        first = await agent.register("r", 5, ranks[0], rank=0, world_size=3)
        assert first.status_code == 202 and len(first.json()["shards"]) == 1
        rest = await asyncio.gather(
            agent.register("r", 5, ranks[1], rank=1, world_size=3),
            agent.register("r", 5, ranks[2], rank=2, world_size=3),
        )
        assert [a.status_code for a in rest] == [202, 202]
        detail = (await agent.http.get("/v1/runs/r/checkpoints/5")).json()
        assert detail["total_bytes"] == 30 and detail["file_count"] == 3
        assert len(detail["jobs"]) == 3


@pytest.mark.parametrize("priority", ["normal"])
async def test_bad_input_never_reaches_the_batch(
    catalog_url: str, tmp_path: Path, priority: str
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        ckpt = write_checkpoint(agent.ssd / "a", {"w.bin": b"a"})
        answers = await asyncio.gather(
            agent.register("r", 1, ckpt, priority=priority),
            agent.register("r", 2, tmp_path / "elsewhere"),
            agent.register("r", 3, agent.ssd / "missing"),
            agent.register("r", 4, ckpt, files=[{"path": "nope.bin", "sha256": "0" * 64}]),
        )
        assert [a.status_code for a in answers] == [202, 400, 400, 400]
        assert await count(agent, Checkpoint) == 1


@pytest.mark.postgres
async def test_catalog_outage_fails_the_whole_batch_with_503_and_no_row(
    proxied_catalog: tuple[str, TcpProxy], tmp_path: Path
) -> None:
    catalog_url, proxy = proxied_catalog
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        paths = [write_checkpoint(agent.ssd / f"s{i}", {"w.bin": b"x"}) for i in range(20)]
        assert (await agent.register("r", 100, paths[0])).status_code == 202  # pool warm
        proxy.cut()
        answers = await asyncio.gather(*(agent.register("r", i, p) for i, p in enumerate(paths)))
        assert [a.status_code for a in answers] == [503] * len(paths), [a.text for a in answers][:2]
        assert all(a.json()["error"]["code"] == "catalog_unavailable" for a in answers)
        assert all(a.headers.get("retry-after") for a in answers)
        proxy.restore()
        deadline = asyncio.get_running_loop().time() + 30
        while (await agent.http.get("/v1/runs")).status_code != 200:
            assert asyncio.get_running_loop().time() < deadline, "catalog did not come back"
            await asyncio.sleep(0.1)
        listed = (await agent.http.get("/v1/runs/r/checkpoints")).json()
        assert [c["step"] for c in listed["checkpoints"]] == [100], "a refused batch left rows"
        assert await count(agent, Job) == 1
        # Sent again, they are registered.
        again = await asyncio.gather(*(agent.register("r", i, p) for i, p in enumerate(paths)))
        assert [a.status_code for a in again] == [202] * len(paths)


async def test_the_flag_for_the_worker_process_is_up_from_submit_until_the_lock_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite with the worker process: the agent's flag (write_gate.UrgentFlag)
    rises with a registration's submit, so the worker begins nothing new, and
    falls once the batch holds the lock, so it waits for one batch at most."""
    from tierckpt.service import write_gate

    flag = write_gate.UrgentFlag()
    monkeypatch.setitem(write_gate._URGENT, "raise", flag)
    catalog = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    async with running_agent(catalog, tmp_path, start_worker=False, catalog=AT_COMMIT) as agent:
        batcher = agent.process.registrations
        seen: list[bool] = []
        real = batcher._sync_transaction
        returned = threading.Event()

        def spy(*args: Any) -> Any:
            seen.append(flag.raised())  # before BEGIN: up
            out = real(*args)
            seen.append(flag.raised())  # the batch took the lock: down
            returned.set()
            return out

        monkeypatch.setattr(batcher, "_sync_transaction", spy)
        path = write_checkpoint(agent.ssd / "a", {"w.bin": b"a"})
        assert (await agent.register("r", 1, path)).status_code == 202
        # The answer can reach the client before the writer's thread is back
        # from the transaction (it is given at the commit, inside it).
        assert await asyncio.to_thread(returned.wait, 10)
        assert seen == [True, False]
        assert not flag.raised()


ON_DISK = {"catalog": {"register_ack": "on_disk"}}


@contextlib.contextmanager
def _fsync_fails_once(database: Path) -> Iterator[threading.Event]:
    """The next fsync of ``database``'s WAL fails with EIO (the event is set
    then); later ones sync."""
    wal = wal_sync_for(str(database))
    real_fsync = wal._fsync
    failed = threading.Event()

    def fails_once() -> None:
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        real_fsync()

    wal._fsync = fails_once  # type: ignore[method-assign]
    try:
        yield failed
    finally:
        wal._fsync = real_fsync  # type: ignore[method-assign]


async def test_a_batch_is_written_while_the_one_before_waits_for_its_fsync(
    tmp_path: Path,
) -> None:
    """SQLite, ``register_ack = "on_disk"``: the write lock is free once a
    batch has committed, before its WAL fsync; the next batch is written
    then, and each batch is answered only once its own fsync is done. Here
    the first fsync is held until the second registration is in the catalog
    (a writer that waited for that fsync would never get there) and
    answered."""
    database = tmp_path / "catalog.db"
    async with running_agent(
        f"sqlite+aiosqlite:///{database}", tmp_path, start_worker=False, **ON_DISK
    ) as agent:
        first = write_checkpoint(agent.ssd / "s1", {"a.bin": b"a"})
        second = write_checkpoint(agent.ssd / "s2", {"b.bin": b"b"})
        wal = wal_sync_for(str(database))
        real_fsync = wal._fsync
        entered, release = threading.Event(), threading.Event()

        def held_once() -> None:
            if not entered.is_set():
                entered.set()
                release.wait(30)
            real_fsync()

        wal._fsync = held_once  # type: ignore[method-assign]
        try:
            one = asyncio.create_task(agent.register("r", 1, first))
            assert await asyncio.to_thread(entered.wait, 10)
            two = await asyncio.wait_for(agent.register("r", 2, second), 10)
            assert two.status_code == 202, two.text
            assert not one.done()  # its fsync is still held: not answered
            steps = sqlite3.connect(database).execute("SELECT step FROM checkpoints").fetchall()
            assert sorted(s for (s,) in steps) == [1, 2]  # both committed
        finally:
            release.set()
            wal._fsync = real_fsync  # type: ignore[method-assign]
        answered = await asyncio.wait_for(one, 10)
        assert answered.status_code == 202, answered.text


async def test_a_failed_fsync_answers_503_and_registering_again_succeeds(tmp_path: Path) -> None:
    """SQLite, ``register_ack = "on_disk"``: the batch committed but its WAL
    could not be synced (EIO): the registration is not known to be on disk,
    so it is not answered 202; the same registration again succeeds
    (idempotent) once the log syncs."""
    database = tmp_path / "catalog.db"
    async with running_agent(
        f"sqlite+aiosqlite:///{database}", tmp_path, start_worker=False, **ON_DISK
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": b"a"})
        with _fsync_fails_once(database):
            answer = await agent.register("r", 1, ckpt)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "catalog_unavailable"
        assert "register it again" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"] == "2"
        # Committed the first time: a repeat of a registration answers 200,
        # after an fsync of its own that covers the first commit too.
        again = await agent.register("r", 1, ckpt)
        assert again.status_code == 200, again.text
        assert again.json()["state"] == "registered"


async def test_a_registration_answered_at_its_commit_is_synced_after(
    tmp_path: Path,
) -> None:
    """SQLite, ``register_ack = "committed"`` (the default): the answer does
    not wait for the WAL's fsync, which still follows at once. Here every
    fsync is held: the registration is answered 202 and is in the catalog
    meanwhile; once released, the held fsync completes and covers it."""
    database = tmp_path / "catalog.db"
    async with running_agent(
        f"sqlite+aiosqlite:///{database}", tmp_path, start_worker=False, catalog=AT_COMMIT
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": b"a"})
        wal = wal_sync_for(str(database))
        real_fsync = wal._fsync
        entered, release = threading.Event(), threading.Event()

        def held() -> None:
            entered.set()
            release.wait(30)
            real_fsync()

        before = wal.fsyncs
        wal._fsync = held  # type: ignore[method-assign]
        try:
            answer = await asyncio.wait_for(agent.register("r", 1, ckpt), 10)
            assert answer.status_code == 202, answer.text
            assert answer.json()["state"] == "registered"
            # The fsync was started (and is held), not skipped.
            assert await asyncio.to_thread(entered.wait, 10)
            steps = sqlite3.connect(database).execute("SELECT step FROM checkpoints").fetchall()
            assert steps == [(1,)]
        finally:
            release.set()
            wal._fsync = real_fsync  # type: ignore[method-assign]
        for _ in range(100):
            if wal.fsyncs > before:
                break
            await asyncio.sleep(0.05)
        assert wal.fsyncs > before


async def test_a_failed_fsync_after_the_answer_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite, the default: an fsync that fails after the registration was
    answered cannot fail it any more; it is logged as an error (the
    registration is committed, survives a kill -9, and not a power loss)."""
    database = tmp_path / "catalog.db"
    async with running_agent(
        f"sqlite+aiosqlite:///{database}", tmp_path, start_worker=False, catalog=AT_COMMIT
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": b"a"})
        with (
            _fsync_fails_once(database) as failed,
            caplog.at_level("ERROR", logger="tierckpt.register"),
        ):
            answer = await agent.register("r", 1, ckpt)
            assert answer.status_code == 202, answer.text
            assert await asyncio.to_thread(failed.wait, 10)
            for _ in range(100):
                if "could not write its log to disk" in caplog.text:
                    break
                await asyncio.sleep(0.05)
        assert "could not write its log to disk" in caplog.text
        assert "Input/output error" in caplog.text


@pytest.mark.parametrize("ack", ["committed", "on_disk"])
async def test_the_postgresql_writer_flushes_its_commits_as_configured(
    postgres_url: str, tmp_path: Path, ack: str
) -> None:
    """PostgreSQL: the registration writer's connections run with
    ``synchronous_commit`` off by default (the commit returns before the
    server's WAL flush), on with ``register_ack = "on_disk"``; the rest of
    the agent's connections keep the server's setting."""
    async with running_agent(
        postgres_url, tmp_path, start_worker=False, catalog={"register_ack": ack}
    ) as agent:
        batcher = agent.process.registrations
        assert batcher._writer_engine is not None
        async with batcher._writer_engine.connect() as conn:
            writer = (await conn.exec_driver_sql("SHOW synchronous_commit")).scalar()
        async with agent.resources.engine.connect() as conn:
            other = (await conn.exec_driver_sql("SHOW synchronous_commit")).scalar()
        assert writer == ("off" if ack == "committed" else "on")
        assert other == "on"
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": b"a"})
        answer = await agent.register(f"r-{ack}", 1, ckpt)
        assert answer.status_code == 202, answer.text
        detail = await agent.http.get(f"/v1/runs/r-{ack}/checkpoints/1")
        assert detail.status_code == 200, detail.text
        assert detail.json()["state"] == "registered"
