"""Prefetch before a restart: which checkpoint, one node-bound job per node.

An orchestrator that knows where a job will restart asks for the run's
checkpoint on those nodes before the trainers start (``POST
/v1/runs/{run}/prefetch``); each node's agent brings it into its T0, verified
(``jobs.py``), and ``latest?node=`` then offers that copy. Only a valid
checkpoint is prefetched: one that is not durable yet, failed, corrupt,
deleted or quarantined is refused by name (409), an unknown one is 404.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import repository as checkpoints
from ..errors import Conflict, NotFound
from ..jobs import kinds
from ..models import VALID_STATES, Checkpoint, Job, Run
from ..resources import Resources
from . import repository as repo
from .schemas import PrefetchJobOut, PrefetchOut, PrefetchPage, PrefetchRequest


async def _run(session: AsyncSession, name: str) -> Run:
    run = await repo.run_named(session, name)
    if run is None:
        raise NotFound(f"run {name!r} has no checkpoints", code="run_not_found")
    return run


async def _checkpoint(
    session: AsyncSession, resources: Resources, run: Run, step: int | None
) -> Checkpoint:
    if step is None:
        latest = await checkpoints.latest_valid(
            session, run.id, resources.settings.durability.min_regions
        )
        if latest is None:
            raise NotFound(
                f"run {run.name!r} has no valid checkpoint yet; nothing to prefetch",
                code="no_valid_checkpoint",
            )
        return latest
    checkpoint = await checkpoints.find_checkpoint(session, run.id, step)
    if checkpoint is None:
        raise NotFound(
            f"run {run.name!r} has no checkpoint at step {step}", code="checkpoint_not_found"
        )
    if checkpoint.state not in VALID_STATES or checkpoint.quarantined_at is not None:
        why = "quarantined" if checkpoint.quarantined_at is not None else checkpoint.state
        raise Conflict(
            f"checkpoint {run.name}:{step} is {why}, not valid: only a durable checkpoint is "
            "prefetched (omit step for the latest valid one)",
            code="not_valid",
        )
    return checkpoint


def _job_out(run: str, job: Job, step: int) -> PrefetchJobOut:
    return PrefetchJobOut(
        id=job.id,
        run=run,
        step=step,
        node=job.node or "",
        state=job.state,
        attempts=job.attempts,
        error=job.last_error,
        created_at=job.created_at,
        finished_at=job.finished_at,
    )


async def request_prefetch(
    session: AsyncSession, resources: Resources, name: str, body: PrefetchRequest
) -> PrefetchOut:
    """Queue one prefetch job per node (a node with one active for this
    checkpoint already keeps it); the jobs as they stand."""
    run = await _run(session, name)
    checkpoint = await _checkpoint(session, resources, run, body.step)
    ids = [
        await kinds.enqueue_prefetch(session, checkpoint.id, node, worker=resources.settings.worker)
        for node in body.nodes
    ]
    found = [i for i in ids if i is not None]
    jobs = await repo.prefetch_jobs(session, run.id, ids=found, limit=len(found))
    by_node = {job.node: _job_out(name, job, step) for job, step in jobs}
    return PrefetchOut(
        run=name, step=checkpoint.step, jobs=[by_node[n] for n in body.nodes if n in by_node]
    )


async def prefetch_status(
    session: AsyncSession, name: str, step: int | None, limit: int
) -> PrefetchPage:
    """The run's prefetch jobs, newest first (of ``step`` only)."""
    run = await _run(session, name)
    jobs = await repo.prefetch_jobs(session, run.id, step=step, limit=limit)
    return PrefetchPage(run=name, jobs=[_job_out(name, job, s) for job, s in jobs])
