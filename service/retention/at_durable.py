"""Retain jobs: a run's retention applied as soon as one of its checkpoints
is durable, not at the next periodic sweep (``[retention] interval_seconds``).

A retain job is queued in the transaction that makes a checkpoint durable
(``state.commit_replica``), one per node holding a shard of it: the first to
run queues the regions' deletions the run's policy asks for (the others find
them queued), and each evicts its own node's T0 copies beyond
``[local] keep_last``. The periodic sweep still runs: it catches what a
retain job that gave up, or a policy changed meanwhile, left behind.

One pass covers every retain job of its run and node queued before it
reads the catalog: each was queued in the transaction that made its
checkpoint durable, which had committed before the pass read anything, so
the pass plans with that checkpoint durable. They are marked done with it
instead of each planning the whole run again: when checkpoints turn durable
faster than the worker gets to their retain jobs (a backlog of uploads),
the run's history was otherwise read and planned once per checkpoint. A
job queued after the pass's first read is not covered and runs.
"""

from __future__ import annotations

import logging

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..db import reading, transaction
from ..jobs import queue
from ..jobs.worker import JobHandler
from ..models import Checkpoint, Job, JobKind, JobState
from ..resources import Resources
from .service import evict_local_copies, queue_deletions

log = logging.getLogger("tierckpt.retention")

# The retain jobs of one run and node still waiting to run.
_QUEUED_OF_RUN = (
    select(Job.id)
    .join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
    .where(
        Job.kind == JobKind.RETAIN,
        Job.state == JobState.QUEUED,
        Job.node == bindparam("node"),
        Checkpoint.run_id == bindparam("run_id"),
    )
)


class RetainJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.RETAIN: JobHandler(run=self.retain, on_failure=self.failed)}

    async def retain(self, job: Job) -> None:
        covered: list[int] = []
        async with reading(self.r.sessionmaker)() as session:
            run_id = await session.scalar(
                select(Checkpoint.run_id).where(Checkpoint.id == job.checkpoint_id)
            )
            if run_id is not None and job.node is not None:
                # Read before planning: see the module's docstring.
                covered = list(
                    await session.scalars(_QUEUED_OF_RUN, {"node": job.node, "run_id": run_id})
                )
        deleted = evicted = 0
        if run_id is not None:
            deleted = await queue_deletions(self.r, run_id)
            evicted = await evict_local_copies(self.r, run_id)
        async with transaction(self.r.sessionmaker) as session:
            await queue.complete(session, job)
            coalesced = await queue.complete_queued(session, covered)
        if coalesced:
            log.debug("retention at durable: %d queued retain job(s) of the run covered", coalesced)
        if deleted or evicted:
            log.info(
                "retention at durable: %d deletion(s) queued, %d T0 copies evicted",
                deleted,
                evicted,
            )
            self.r.wake()

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        # Nothing to record on a checkpoint: the periodic sweep does this work later.
        log.warning("retention at durable gave up (the periodic sweep will apply it): %s", error)
