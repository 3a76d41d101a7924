"""The scrub pass: re-verify replicas, least recently verified first, within a
byte budget per hour so it never competes with uploads; and re-read the
peer copies this node holds (peers/scrub.py). The agent runs it
every ``[scrub].interval_seconds`` (agent.py, periodic.py)."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import func, select

from ..config import ScrubSettings
from ..db import reading, transaction
from ..jobs import kinds
from ..models import Checkpoint, CheckpointState, Replica, ReplicaState, utcnow
from ..peers.scrub import verify_peer_copies
from ..resources import Resources

log = logging.getLogger("tierckpt.scrub")


class Scrubber:
    def __init__(self, resources: Resources, settings: ScrubSettings) -> None:
        self.r = resources
        self.settings = settings

    async def run_once(self) -> None:
        queued = await self.tick()
        if queued:
            log.info("scrub: queued verification of %d replica(s)", queued)
            self.r.wake()
        # The peer copies this node holds are re-read here, not by jobs: only
        # this node can read them.
        await verify_peer_copies(self.r, self.settings)

    async def tick(self) -> int:
        """Queue verify jobs for the stalest replicas within this interval's budget."""
        budget = self.settings.bytes_per_hour * self.settings.interval_seconds / 3600
        stale_before = utcnow() - timedelta(hours=self.settings.min_age_hours)
        queued = 0
        # Chosen on a read snapshot (no write lock held while it reads), then
        # queued in one short transaction: a replica deleted or repaired in
        # between is found so by its verify job, which checks under the
        # checkpoint's lock.
        async with reading(self.r.sessionmaker)() as session:
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
            candidates = [
                (checkpoint_id, region, size)
                for checkpoint_id, region, size in rows
                if region in self.r.stores
            ]
        if not candidates:
            return 0
        async with transaction(self.r.sessionmaker) as session:
            spent = 0
            for checkpoint_id, region, size in candidates:
                if queued and spent + size > budget:
                    break
                if await kinds.enqueue_verify(session, checkpoint_id, region):
                    queued += 1
                    spent += size
        return queued
