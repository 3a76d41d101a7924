"""Retain jobs: a run's retention applied as soon as one of its checkpoints
is durable, not at the next periodic sweep (``[retention] interval_seconds``).

A retain job is queued in the transaction that makes a checkpoint durable
(``state.commit_replica``), one per node holding a shard of it: the first to
run queues the regions' deletions the run's policy asks for (the others find
them queued), and each evicts its own node's T0 copies beyond
``[local] keep_last``. The periodic sweep still runs: it catches what a
retain job that gave up, or a policy changed meanwhile, left behind.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..db import reading, transaction
from ..jobs import queue
from ..jobs.worker import JobHandler
from ..models import Checkpoint, Job, JobKind
from ..resources import Resources
from .service import evict_local_copies, queue_deletions

log = logging.getLogger("tierckpt.retention")


class RetainJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.RETAIN: JobHandler(run=self.retain, on_failure=self.failed)}

    async def retain(self, job: Job) -> None:
        async with reading(self.r.sessionmaker)() as session:
            run_id = await session.scalar(
                select(Checkpoint.run_id).where(Checkpoint.id == job.checkpoint_id)
            )
        deleted = evicted = 0
        if run_id is not None:
            deleted = await queue_deletions(self.r, run_id)
            evicted = await evict_local_copies(self.r, run_id)
        async with transaction(self.r.sessionmaker) as session:
            await queue.complete(session, job)
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
