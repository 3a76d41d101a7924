"""Verify jobs: re-read a region's copy, re-hash it, and repair what went bad.

A mismatch (or a missing object) marks that replica ``corrupt`` with the
reason and schedules a repair: a replicate job from a region whose copy is
intact, or, when none is left, a re-upload from the T0 copy on the node that
registered it (which must still hash to the catalog's SHA-256). An
unreachable region is an outage, not corruption: the job just retries.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..checkpoints.contents import load_contents
from ..checkpoints.state import FINAL, lock_checkpoint, refresh_state
from ..db import transaction
from ..jobs import kinds, queue
from ..jobs.kinds import UploadMode
from ..jobs.worker import JobHandler, region_store
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
from ..resources import Resources
from ..storage.base import ObjectNotFound, ObjectStore
from ..storage.manifest import ObjectEntry, manifest_digest
from .verifier import verify_objects

OBJECTS_IN_FLIGHT = 4  # reads per agent, shared by its verify jobs


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
        await kinds.enqueue_replication(session, checkpoint, resources.stores)
        return f"repair from {sources[0]} scheduled"
    shards = list(await session.scalars(select(Shard).where(Shard.checkpoint_id == checkpoint.id)))
    if not shards or any(not s.path for s in shards):
        return "no intact copy left to repair from"
    for shard in shards:
        await kinds.enqueue_upload(
            session,
            checkpoint.id,
            shard_id=shard.id,
            region=region,
            node=shard.node,
            mode=UploadMode.REPAIR,
            worker=resources.settings.worker,
        )
    return "repair from the local (T0) copy scheduled"


class VerifyJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self.objects_in_flight = asyncio.Semaphore(OBJECTS_IN_FLIGHT)

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.VERIFY: JobHandler(run=self.verify, on_failure=self.failed)}

    async def verify(self, job: Job) -> None:
        assert job.region is not None
        store = region_store(self.r.stores, job)
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
            expected = contents.objects
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
                await replicas.mark_verified(
                    session,
                    job.checkpoint_id,
                    job.region,
                    ReplicaState.CORRUPT,
                    now=now,
                    error=error,
                )
                await self._refresh(session, checkpoint)
                repair = await schedule_repair(session, checkpoint, job.region, self.r)
                await replicas.note_error(
                    session, job.checkpoint_id, job.region, f"{error}; {repair}"
                )
            else:
                await replicas.mark_verified(
                    session,
                    job.checkpoint_id,
                    job.region,
                    ReplicaState.COMMITTED,
                    now=now,
                    error=None,
                )
                await self._refresh(session, checkpoint)
        metrics.observe_verify(job.region, corrupt=bool(problems))

    async def _check(
        self,
        store: ObjectStore,
        expected: list[ObjectEntry],
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

        # Store errors other than "not found" propagate: an outage is retried,
        # never taken for corruption.
        verification = await verify_objects(
            store,
            expected,
            slots=self.objects_in_flight,
            width=OBJECTS_IN_FLIGHT,
            collect_read_errors=False,
        )
        for bad in verification.bad:
            obj = bad.entry
            if bad.missing:
                problems.append(f"{obj.key} is missing")
            elif bad.larger:
                problems.append(f"{obj.key}: larger than the expected {obj.size} bytes")
            elif bad.size != obj.size:
                problems.append(f"{obj.key}: size {bad.size}, expected {obj.size}")
            else:
                digest = bad.sha256 or ""
                problems.append(f"{obj.key}: sha256 {digest[:16]}…, expected {obj.sha256[:16]}…")
        return sorted(problems)

    async def _refresh(self, session: AsyncSession, checkpoint: Checkpoint) -> None:
        settings = self.r.settings
        await refresh_state(
            session, checkpoint, settings.durability.min_regions, len(settings.regions)
        )

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        assert job.region is not None
        await replicas.note_error(
            session, job.checkpoint_id, job.region, f"verification could not run: {error}"
        )
