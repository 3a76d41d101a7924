"""Verify jobs: re-read a region's copy, re-hash it, and repair what went bad.

A mismatch (or a missing object) marks that replica ``corrupt`` with the
reason and schedules a repair: a replicate job from a region whose copy is
intact, or, when none is left, a re-upload from the T0 copy on the node that
registered it (which must still hash to the catalog's SHA-256). An
unreachable region is an outage, not corruption: the job just retries.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints.contents import load_contents
from ..checkpoints.state import FINAL, lock_checkpoint, refresh_state
from ..concurrency import gather_or_cancel
from ..db import transaction
from ..jobs import queue
from ..jobs.worker import JobHandler, PermanentJobError
from ..models import (
    Checkpoint,
    Job,
    JobKind,
    Replica,
    ReplicaState,
    Shard,
    utcnow,
)
from ..observability import metrics
from ..replication.jobs import enqueue_replication
from ..resources import Resources
from ..storage.base import ObjectNotFound, ObjectStore
from ..uploads.manifest import manifest_digest

VERIFY_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class ExpectedObject:
    key: str
    size: int
    sha256: str


async def enqueue_verify(
    session: AsyncSession, checkpoint_id: int, region: str, priority: int = 0
) -> bool:
    return await queue.enqueue(
        session,
        JobKind.VERIFY,
        checkpoint_id,
        region=region,
        priority=priority,
        max_attempts=VERIFY_MAX_ATTEMPTS,
    )


async def hash_object(store: ObjectStore, key: str) -> tuple[int, str]:
    hasher = hashlib.sha256()
    size = 0
    async for chunk in store.iter_range(key, chunk_size=4 << 20):
        size += len(chunk)
        await asyncio.to_thread(hasher.update, chunk)
    return size, hasher.hexdigest()


async def schedule_repair(
    session: AsyncSession, checkpoint: Checkpoint, region: str, resources: Resources
) -> str:
    """Queue the repair of ``region``'s copy; say from where."""
    good = await session.scalars(
        select(Replica.region).where(
            Replica.checkpoint_id == checkpoint.id,
            Replica.state == ReplicaState.COMMITTED,
            Replica.region != region,
        )
    )
    sources = [name for name in good if name in resources.stores]
    if sources:
        await enqueue_replication(session, checkpoint, resources)
        return f"repair from {sources[0]} scheduled"
    shards = list(await session.scalars(select(Shard).where(Shard.checkpoint_id == checkpoint.id)))
    if not shards or any(not s.path for s in shards):
        return "no intact copy left to repair from"
    for shard in shards:
        await queue.enqueue(
            session,
            JobKind.UPLOAD,
            checkpoint.id,
            shard_id=shard.id,
            region=region,
            node=shard.node,
            payload={"repair": True},
            max_attempts=resources.settings.worker.max_attempts,
        )
    return "repair from the local (T0) copy scheduled"


class VerifyJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self.objects_in_flight = asyncio.Semaphore(4)

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.VERIFY: JobHandler(run=self.verify, on_failure=self.failed)}

    async def verify(self, job: Job) -> None:
        assert job.region is not None
        store = self.r.stores.get(job.region)
        if store is None:
            raise PermanentJobError(f"region {job.region!r} is not configured on this agent")
        async with transaction(self.r.sessionmaker) as session:
            checkpoint = await lock_checkpoint(session, job.checkpoint_id)
            replica = await session.scalar(
                select(Replica).where(
                    Replica.checkpoint_id == job.checkpoint_id, Replica.region == job.region
                )
            )
            if (
                checkpoint is None
                or checkpoint.state in FINAL
                or replica is None
                or replica.state not in (ReplicaState.COMMITTED, ReplicaState.CORRUPT)
            ):
                await queue.complete(session, job)  # nothing (left) to verify there
                return
            contents = await load_contents(session, checkpoint)
            expected = [ExpectedObject(o.key, o.size, o.sha256 or "") for o in contents.objects]
            manifest_key = contents.manifest_key(checkpoint)
            manifest_sha256 = replica.manifest_sha256

        problems = await self._check(store, expected, manifest_key, manifest_sha256)

        async with transaction(self.r.sessionmaker) as session:
            checkpoint = await lock_checkpoint(session, job.checkpoint_id)
            assert checkpoint is not None
            await queue.complete(session, job)
            now = utcnow()
            if problems:
                error = "; ".join(problems[:5]) + (
                    f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
                )
                await self._set_replica(session, job, ReplicaState.CORRUPT, now, error)
                await self._refresh(session, checkpoint)
                repair = await schedule_repair(session, checkpoint, job.region, self.r)
                await self._set_replica(
                    session, job, ReplicaState.CORRUPT, now, f"{error}; {repair}"
                )
            else:
                await self._set_replica(session, job, ReplicaState.COMMITTED, now, None)
                await self._refresh(session, checkpoint)
        metrics.observe_verify(job.region, corrupt=bool(problems))

    async def _check(
        self,
        store: ObjectStore,
        expected: list[ExpectedObject],
        manifest_key: str,
        manifest_sha256: str | None,
    ) -> list[str]:
        problems: list[str] = []
        try:
            manifest = await store.get_range(manifest_key, 0, 16 << 20)
            if manifest_sha256 and manifest_digest(manifest) != manifest_sha256:
                problems.append("MANIFEST.json differs from the committed one")
        except ObjectNotFound:
            problems.append("MANIFEST.json is missing")

        async def one(obj: ExpectedObject) -> None:
            async with self.objects_in_flight:
                try:
                    size, digest = await hash_object(store, obj.key)
                except ObjectNotFound:
                    problems.append(f"{obj.key} is missing")
                    return
            if size != obj.size:
                problems.append(f"{obj.key}: size {size}, expected {obj.size}")
            elif digest != obj.sha256:
                problems.append(f"{obj.key}: sha256 {digest[:16]}…, expected {obj.sha256[:16]}…")

        # Store errors other than "not found" propagate: an outage is retried,
        # never taken for corruption.
        await gather_or_cancel(*(one(o) for o in expected))
        return sorted(problems)

    async def _set_replica(
        self, session: AsyncSession, job: Job, state: str, now: object, error: str | None
    ) -> None:
        await session.execute(
            update(Replica)
            .where(Replica.checkpoint_id == job.checkpoint_id, Replica.region == job.region)
            .values(state=state, verified_at=now, error=error[:4000] if error else None)
        )

    async def _refresh(self, session: AsyncSession, checkpoint: Checkpoint) -> None:
        settings = self.r.settings
        await refresh_state(
            session, checkpoint, settings.durability.min_regions, len(settings.regions)
        )

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        await session.execute(
            update(Replica)
            .where(Replica.checkpoint_id == job.checkpoint_id, Replica.region == job.region)
            .values(error=f"verification could not run: {error}"[:4000])
        )
