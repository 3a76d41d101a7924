"""The worker while its agent drains, on a real catalog (SQLite and PostgreSQL):
work any agent can do is given back at once, only the node's own is claimed."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from tierckpt.service.config import WorkerSettings
from tierckpt.service.db import transaction
from tierckpt.service.jobs import queue
from tierckpt.service.jobs.worker import JobHandler, Worker
from tierckpt.service.models import Job, JobState


@pytest.fixture
async def catalog(seeded_catalog):  # type: ignore[no-untyped-def]
    return await seeded_catalog(4)


async def wait_until(predicate, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        # Polls the catalog: no event to wait on there.
        while True:
            if await predicate():
                return
            await asyncio.sleep(0.02)


async def test_draining_worker_gives_back_shared_work_and_runs_the_nodes(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    started: list[str] = []
    cancelled: list[str] = []

    async def blocks(job: Job) -> None:
        started.append(job.kind)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(job.kind)
            raise

    async def completes(job: Job) -> None:
        started.append(job.kind)
        async with transaction(sessionmaker) as session:
            await queue.complete(session, job)

    async def no_failure(*_args: object) -> None:
        return None

    handlers = {
        "replicate": JobHandler(blocks, no_failure),
        "upload": JobHandler(completes, no_failure),
    }
    worker = Worker(sessionmaker, handlers, WorkerSettings(concurrency=1, poll_interval=0.05), "n1")
    async with transaction(sessionmaker) as session:
        await queue.enqueue(session, "replicate", ids[0], region="west")
    task = worker.start()
    try:

        async def replicating() -> bool:
            return started == ["replicate"]

        await wait_until(replicating)
        # The one slot is taken by work any agent can do; the node's own
        # urgent upload arrives as the node is told to go.
        async with transaction(sessionmaker) as session:
            await queue.enqueue(session, "upload", ids[1], region="east", node="n1", priority=100)
        worker.begin_drain()

        async def upload_done() -> bool:
            async with sessionmaker() as session:
                return await queue.node_work_left(session, "n1") == 0

        await wait_until(upload_done)
        assert cancelled == ["replicate"] and started == ["replicate", "upload"]
        async with sessionmaker() as session:
            jobs = {job.kind: job for job in (await session.scalars(select(Job))).all()}
        # Given back untouched, for another agent: queued, the attempt not counted.
        assert jobs["replicate"].state == JobState.QUEUED and jobs["replicate"].attempts == 0
        assert jobs["upload"].state == JobState.SUCCEEDED
    finally:
        await worker.stop(0)
        await asyncio.gather(task, return_exceptions=True)
