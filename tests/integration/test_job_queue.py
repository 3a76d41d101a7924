"""The catalog job queue on SQLite and PostgreSQL: claims, leases, retries, dedupe."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from tierckpt.service.db import create_engine, create_sessionmaker, transaction
from tierckpt.service.jobs import queue
from tierckpt.service.migrate import upgrade
from tierckpt.service.models import Checkpoint, Job, JobState, Run, utcnow


@pytest.fixture
async def catalog(catalog_url: str):  # type: ignore[no-untyped-def]
    await asyncio.to_thread(upgrade, catalog_url)
    engine = create_engine(catalog_url)
    sessionmaker = create_sessionmaker(engine)
    async with transaction(sessionmaker) as session:
        run = Run(name="r")
        session.add(run)
        await session.flush()
        checkpoints = [Checkpoint(run_id=run.id, step=s) for s in range(40)]
        session.add_all(checkpoints)
    yield sessionmaker, [c.id for c in checkpoints]
    await engine.dispose()


async def claim(sessionmaker, node: str = "n1", lease: float = 30):  # type: ignore[no-untyped-def]
    async with transaction(sessionmaker) as session:
        return await queue.claim(session, owner=f"{node}:1:x", node=node, lease_seconds=lease)


async def test_dedupe_priority_and_node_binding(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        assert await queue.enqueue(session, "upload", ids[0], region="east", node="n2")
        assert not await queue.enqueue(session, "upload", ids[0], region="east", node="n2")
        assert await queue.enqueue(session, "commit", ids[1], region="east")
        assert await queue.enqueue(session, "commit", ids[2], region="east", priority=100)

    first = await claim(sessionmaker)
    second = await claim(sessionmaker)
    assert (first.checkpoint_id, second.checkpoint_id) == (ids[2], ids[1])  # urgent first
    assert await claim(sessionmaker) is None  # the upload belongs to node n2
    bound = await claim(sessionmaker, node="n2")
    assert bound is not None and bound.kind == "upload"

    async with transaction(sessionmaker) as session:
        await queue.complete(session, bound)
        # Finished: the same work may be queued again (a new attempt later on).
        assert await queue.enqueue(session, "upload", ids[0], region="east", node="n2")


async def test_expired_lease_is_reclaimed_and_old_owner_cannot_finish(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        await queue.enqueue(session, "commit", ids[0])
    stale = await claim(sessionmaker, lease=30)
    assert await claim(sessionmaker) is None  # leased

    async with transaction(sessionmaker) as session:
        await session.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    fresh = await claim(sessionmaker, node="n1")
    assert fresh is not None and fresh.id == stale.id and fresh.attempts == 2

    with pytest.raises(queue.LeaseLost):
        async with transaction(sessionmaker) as session:
            await queue.complete(session, stale)
    async with transaction(sessionmaker) as session:
        await queue.complete(session, fresh)
        job = await session.get_one(Job, fresh.id)
        assert job.state == JobState.SUCCEEDED and job.dedupe_key is None


async def test_retry_waits_for_backoff_and_release_does_not_count(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        await queue.enqueue(session, "commit", ids[0])
    job = await claim(sessionmaker)
    async with transaction(sessionmaker) as session:
        await queue.retry_later(session, job, "S3 said 503", delay_seconds=60)
    assert await claim(sessionmaker) is None  # not before its backoff

    async with transaction(sessionmaker) as session:
        await session.execute(update(Job).values(run_after=utcnow()))
    job = await claim(sessionmaker)
    assert job.attempts == 2 and job.last_error == "S3 said 503"
    async with transaction(sessionmaker) as session:
        await queue.release(session, job)
    job = await claim(sessionmaker)
    assert job.attempts == 2


async def test_release_node_leases_frees_a_dead_incarnations_jobs(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        await queue.enqueue(session, "upload", ids[0], node="n1")
        await queue.enqueue(session, "commit", ids[1])
    await claim(sessionmaker, node="n1")
    other = await claim(sessionmaker, node="n1_")  # a node whose name is a LIKE wildcard
    assert other is not None
    async with transaction(sessionmaker) as session:
        assert await queue.release_node_leases(session, "n1") == 1
    again = await claim(sessionmaker, node="n1")
    assert again is not None and again.checkpoint_id == ids[0]


async def test_concurrent_claimers_never_share_a_job(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        for checkpoint_id in ids:
            await queue.enqueue(session, "commit", checkpoint_id)

    claimed: list[int] = []

    async def claimer(n: int) -> None:
        while (job := await claim(sessionmaker, node=f"n{n}")) is not None:
            claimed.append(job.id)

    await asyncio.gather(*(claimer(n) for n in range(8)))
    assert len(claimed) == len(ids) == len(set(claimed))
    async with transaction(sessionmaker) as session:
        running = (await session.scalars(select(Job).where(Job.state == JobState.RUNNING))).all()
        assert len(running) == len(ids)
