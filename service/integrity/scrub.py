"""The scrub pass: re-verify replicas, least recently verified first, within a
byte budget per hour so it never competes with uploads; and re-read the
peer copies this node holds (peers/scrub.py). The agent runs it
every ``[scrub].interval_seconds`` (agent.py, periodic.py)."""

from __future__ import annotations

import logging
from datetime import timedelta
from functools import partial
from typing import Any

from sqlalchemy import func, select

from ..config import ScrubSettings
from ..db import reading, transaction_giving_way
from ..jobs import kinds, queue
from ..models import Checkpoint, CheckpointState, Replica, ReplicaState, utcnow
from ..peers.scrub import verify_peer_copies
from ..resources import Resources

log = logging.getLogger("tierckpt.scrub")

# Verify jobs queued per statement and transaction.
ENQUEUE_CHUNK = 16


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
        # queued in short transactions: a replica deleted or repaired in
        # between is found so by its verify job, which checks under the
        # checkpoint's lock. The budget counts what was chosen, whether or
        # not its verify job was queued already.
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
        chosen: list[dict[str, Any]] = []
        spent = 0
        for checkpoint_id, region, size in candidates:
            if chosen and spent + size > budget:
                break
            chosen.append(kinds.verify_row(checkpoint_id, region))
            spent += size
        # A statement per chunk, a short transaction each (giving way to a
        # registration that waits): one transaction for a whole budget of
        # small checkpoints held the write lock for 60-150 ms.
        for first in range(0, len(chosen), ENQUEUE_CHUNK):
            chunk = chosen[first : first + ENQUEUE_CHUNK]
            queued += await transaction_giving_way(
                self.r.sessionmaker, partial(queue.enqueue_rows, rows=chunk)
            )
        return queued
