"""The periodic scrubber: re-verify replicas, least recently verified first,
within a byte budget per hour so it never competes with uploads."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sqlalchemy import func, select

from ..config import ScrubSettings
from ..db import transaction
from ..models import Checkpoint, CheckpointState, Replica, ReplicaState, utcnow
from ..resources import Resources
from .jobs import enqueue_verify

log = logging.getLogger("tierckpt.scrub")


class Scrubber:
    def __init__(self, resources: Resources, settings: ScrubSettings) -> None:
        self.r = resources
        self.settings = settings
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="tierckpt-scrubber")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            try:
                queued = await self.tick()
                if queued:
                    log.info("scrub: queued verification of %d replica(s)", queued)
                    self.r.wake_worker()
            except Exception as exc:  # the catalog may be down; try next time
                log.warning("scrub pass failed: %s", exc)
            await asyncio.sleep(self.settings.interval_seconds)

    async def tick(self) -> int:
        """Queue verify jobs for the stalest replicas within this interval's budget."""
        budget = self.settings.bytes_per_hour * self.settings.interval_seconds / 3600
        stale_before = utcnow() - timedelta(hours=self.settings.min_age_hours)
        queued = 0
        async with transaction(self.r.sessionmaker) as session:
            rows = await session.execute(
                select(Replica.checkpoint_id, Replica.region, Checkpoint.total_bytes)
                .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
                .where(
                    Replica.state == ReplicaState.COMMITTED,
                    Checkpoint.state.in_((CheckpointState.DURABLE, CheckpointState.REPLICATED)),
                    func.coalesce(Replica.verified_at, Replica.committed_at) < stale_before,
                )
                .order_by(func.coalesce(Replica.verified_at, Replica.committed_at))
                .limit(1000)
            )
            spent = 0
            for checkpoint_id, region, size in rows:
                if region not in self.r.stores:
                    continue
                if queued and spent + size > budget:
                    break
                if await enqueue_verify(session, checkpoint_id, region):
                    queued += 1
                    spent += size
        return queued
