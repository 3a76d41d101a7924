"""A job that claims the job it enqueued has the worker run it next, in the
same task, on a real catalog (SQLite and PostgreSQL); a stop gives the
unstarted follow-up back untouched."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from tests.integration.test_worker_drain import wait_until
from tierckpt.service.config import WorkerSettings
from tierckpt.service.db import transaction
from tierckpt.service.jobs import queue
from tierckpt.service.jobs.worker import JobHandler, Worker, follow_ups
from tierckpt.service.models import Job, JobState


@pytest.fixture
async def catalog(seeded_catalog):  # type: ignore[no-untyped-def]
    return await seeded_catalog(2)


async def no_failure(*_args: object) -> None:
    return None


def worker_for(sessionmaker, handlers) -> Worker:  # type: ignore[no-untyped-def]
    # A long poll: a commit found by the claim loop instead would take seconds.
    settings = WorkerSettings(concurrency=2, poll_interval=30)
    return Worker(sessionmaker, handlers, settings, "n1")


async def upload_then_claim_commit(sessionmaker, job: Job) -> None:  # type: ignore[no-untyped-def]
    pending = follow_ups()
    assert pending is not None
    async with transaction(sessionmaker) as session:
        await queue.complete(session, job)
        commit_id = await queue.enqueue(session, "commit", job.checkpoint_id, region="east")
        assert commit_id is not None
        commit = await queue.claim_queued(
            session, commit_id, owner=pending.owner, lease_seconds=pending.lease_seconds
        )
    assert commit is not None and commit.state == JobState.RUNNING
    pending.add(commit)


async def test_the_claimed_job_runs_next_in_the_same_task(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    tasks: dict[str, asyncio.Task[object] | None] = {}

    async def upload(job: Job) -> None:
        tasks["upload"] = asyncio.current_task()
        await upload_then_claim_commit(sessionmaker, job)

    async def commit(job: Job) -> None:
        tasks["commit"] = asyncio.current_task()
        async with transaction(sessionmaker) as session:
            await queue.complete(session, job)

    handlers = {"upload": JobHandler(upload, no_failure), "commit": JobHandler(commit, no_failure)}
    worker = worker_for(sessionmaker, handlers)
    task = worker.start()
    await asyncio.sleep(0.2)  # the first claim found nothing: the worker now waits 30 s
    try:
        async with transaction(sessionmaker) as session:
            await queue.enqueue(session, "upload", ids[0], region="east", node="n1")
        worker.wake()

        async def committed() -> bool:
            async with transaction(sessionmaker) as session:
                states = await session.scalars(select(Job.state).where(Job.kind == "commit"))
                return list(states) == [JobState.SUCCEEDED]

        await wait_until(committed)
        assert tasks["commit"] is tasks["upload"] is not None
    finally:
        await worker.stop(grace=0)
        await task


async def test_a_stopped_task_gives_its_follow_up_back(catalog) -> None:  # type: ignore[no-untyped-def]
    sessionmaker, ids = catalog
    claimed = asyncio.Event()

    async def upload(job: Job) -> None:
        pending = follow_ups()
        assert pending is not None
        async with transaction(sessionmaker) as session:
            commit_id = await queue.enqueue(session, "commit", job.checkpoint_id, region="east")
            assert commit_id is not None
            commit = await queue.claim_queued(
                session, commit_id, owner=pending.owner, lease_seconds=pending.lease_seconds
            )
        assert commit is not None
        pending.add(commit)
        claimed.set()
        await asyncio.Event().wait()  # still uploading when the worker stops

    async def commit(job: Job) -> None:
        raise AssertionError("the follow-up of a cancelled job must not run")

    handlers = {"upload": JobHandler(upload, no_failure), "commit": JobHandler(commit, no_failure)}
    worker = worker_for(sessionmaker, handlers)
    async with transaction(sessionmaker) as session:
        await queue.enqueue(session, "upload", ids[0], region="east", node="n1")
    task = worker.start()
    await asyncio.wait_for(claimed.wait(), 10)
    await worker.stop(grace=0)
    await task
    async with transaction(sessionmaker) as session:
        jobs = {j.kind: j for j in await session.scalars(select(Job))}
    # Both given back as they were: queued, the attempt not counted, no lease.
    for kind in ("upload", "commit"):
        assert (jobs[kind].state, jobs[kind].attempts, jobs[kind].lease_token) == (
            JobState.QUEUED,
            0,
            None,
        ), kind
