"""The catalog job queue on SQLite and PostgreSQL: claims, leases, retries, dedupe."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from tierckpt.service.db import transaction
from tierckpt.service.jobs import queue
from tierckpt.service.models import Job, JobState, Shard, utcnow


@pytest.fixture
async def catalog(seeded_catalog):  # type: ignore[no-untyped-def]
    return await seeded_catalog(40)


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


async def test_a_draining_node_claims_only_its_own_work_urgent_first(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    async with transaction(sessionmaker) as session:
        for checkpoint_id, node in ((ids[2], "n1"), (ids[3], "n2")):
            session.add(
                Shard(checkpoint_id=checkpoint_id, rank=0, node=node, path="/p", fingerprint="f")
            )
        await queue.enqueue(session, "upload", ids[0], region="east", node="n1")
        await queue.enqueue(session, "upload", ids[1], region="east", node="n1", priority=100)
        await queue.enqueue(session, "commit", ids[2], region="east")  # a shard on n1
        await queue.enqueue(session, "commit", ids[3], region="east")  # only on n2
        await queue.enqueue(session, "replicate", ids[4], region="west", priority=100)
        await queue.enqueue(session, "upload", ids[5], region="east", node="n2")
    async with sessionmaker() as session:
        assert await queue.node_work_left(session, "n1") == 3

    async def drain_claim():  # type: ignore[no-untyped-def]
        async with transaction(sessionmaker) as session:
            return await queue.claim(
                session, owner="n1:1:x", node="n1", lease_seconds=30, node_work_only=True
            )

    claimed = [await drain_claim() for _ in range(4)]
    assert claimed[3] is None  # the replicate job and n2's work are left to others
    assert [(j.kind, j.checkpoint_id) for j in claimed[:3]] == [
        ("upload", ids[1]),  # urgent first
        ("upload", ids[0]),
        ("commit", ids[2]),
    ]
    async with sessionmaker() as session:
        assert await queue.node_work_left(session, "n1") == 3  # running still counts
    async with transaction(sessionmaker) as session:
        for job in claimed[:3]:
            await queue.complete(session, job)
    async with sessionmaker() as session:
        assert await queue.node_work_left(session, "n1") == 0
    # Not draining: the node takes shared work too.
    replicate = await claim(sessionmaker, node="n1")
    assert replicate is not None and replicate.kind == "replicate"


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
