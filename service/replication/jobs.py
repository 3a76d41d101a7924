"""Replicate jobs: copy a committed checkpoint into another region, manifest last.

The same job repairs a corrupt replica: the target's objects are rewritten
from a good region. Objects are copied server-side when both regions are on
one S3 endpoint; otherwise they are streamed with bounded memory, and the
streamed bytes are hashed and checked against the catalog on the way, so a
bad source is caught before it is copied. Replication never gives up: an
outage of the target region only delays it (backoff), it never drops it.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from functools import partial

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..checkpoints.contents import load_contents
from ..checkpoints.state import commit_replica, lock_checkpoint
from ..concurrency import gather_or_cancel
from ..db import transaction_giving_way
from ..jobs import queue
from ..jobs.withdraw import withdraw_then_complete
from ..jobs.worker import JobHandler, region_store
from ..models import CheckpointState, Job, JobKind, Replica, ReplicaState
from ..observability import context, metrics
from ..resources import Resources
from ..storage.base import ObjectStore, PartRef, StoreError
from ..storage.leftovers import abort_left_uploads
from ..storage.manifest import ObjectEntry, manifest_digest


class SourceCorrupt(Exception):
    """The bytes read from the source region do not hash to the catalog's SHA-256."""


@dataclass(frozen=True)
class _Plan:
    sources: list[str]  # committed regions to copy from, primary first
    objects: list[ObjectEntry]
    manifest: bytes
    manifest_key: str
    step_prefix: str


@dataclass
class _TakeBack:
    """The checkpoint was deleted: what an earlier run may have left."""

    keys: list[str]
    step_prefix: str


async def stream_copy(
    source: ObjectStore,
    target: ObjectStore,
    obj: ObjectEntry,
    part_size: int,
    parts: asyncio.Semaphore,
) -> None:
    """Read ``obj`` from source part by part, hash it in order, write it to
    target; the held parts are bounded by ``parts``."""
    hasher = hashlib.sha256()
    if obj.size <= part_size:
        async with parts:
            data = await source.get_range(obj.key, 0, obj.size)
            await asyncio.to_thread(hasher.update, data)
            _check(obj, hasher, len(data))
            await target.put_bytes(obj.key, data)
        return
    upload = await target.create_multipart(obj.key)
    sends: list[asyncio.Task[PartRef]] = []

    async def send(number: int, offset: int, data: bytes) -> PartRef:
        try:
            return await target.upload_part(upload, number, offset, data)
        finally:
            parts.release()

    try:
        seen = 0
        for number, offset in enumerate(range(0, obj.size, part_size), start=1):
            await parts.acquire()
            try:
                data = await source.get_range(obj.key, offset, min(part_size, obj.size - offset))
                await asyncio.to_thread(hasher.update, data)
            except BaseException:
                parts.release()
                raise
            seen += len(data)
            sends.append(asyncio.create_task(send(number, offset, data)))
            del data
        _check(obj, hasher, seen)
        await target.complete_multipart(upload, list(await asyncio.gather(*sends)))
    except BaseException:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await target.abort_multipart(upload)
        raise


def _check(obj: ObjectEntry, hasher: hashlib._Hash, size: int) -> None:
    if size != obj.size or hasher.hexdigest() != obj.sha256:
        raise SourceCorrupt(
            f"{obj.key}: source bytes do not match the catalog (size {size}/{obj.size}, "
            f"sha256 {hasher.hexdigest()[:12]}…/{obj.sha256[:12]}…)"
        )


class ReplicationJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        upload = resources.settings.upload
        self.part_size = upload.part_size_mb * 1024 * 1024
        self.parts = asyncio.Semaphore(upload.parts_in_flight)
        self.files = asyncio.Semaphore(upload.files_in_flight)

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.REPLICATE: JobHandler(run=self.replicate, on_failure=self.failed)}

    async def _plan(self, job: Job) -> _Plan | _TakeBack | None:
        async def plan(session: AsyncSession) -> _Plan | _TakeBack | None:
            checkpoint = await lock_checkpoint(session, job.checkpoint_id)
            if checkpoint is None or checkpoint.state == CheckpointState.FAILED:
                await queue.complete(session, job)
                return None
            if checkpoint.state == CheckpointState.DELETED:
                # An earlier run may have landed objects after the deletion's
                # sweep and been killed before taking them back.
                contents = await load_contents(session, checkpoint)
                return _TakeBack(
                    [contents.manifest_key(checkpoint), *(o.key for o in contents.objects)],
                    contents.step_prefix(checkpoint),
                )
            target = await session.scalar(
                select(Replica).where(
                    Replica.checkpoint_id == checkpoint.id, Replica.region == job.region
                )
            )
            if target is None or target.state == ReplicaState.COMMITTED:
                await queue.complete(session, job)  # already there (or not ours to copy)
                return None
            context.note(repair=target.state == ReplicaState.CORRUPT)
            if not await queue.supersede_uploads(session, checkpoint.id, target.region):
                raise StoreError(
                    f"an upload from the node's local copy into {job.region} is in progress"
                )
            sources = [
                r.region
                for r in await session.scalars(
                    select(Replica).where(
                        Replica.checkpoint_id == checkpoint.id,
                        Replica.state == ReplicaState.COMMITTED,
                    )
                )
                if r.region in self.r.stores
            ]
            contents = await load_contents(session, checkpoint)
            layout = region_store(self.r.stores, job).key_layout
            return _Plan(
                sources,
                contents.objects,
                contents.manifest(checkpoint, layout),
                contents.manifest_key(checkpoint),
                contents.step_prefix(checkpoint),
            )

        found = await transaction_giving_way(self.r.sessionmaker, plan)
        if found is None or isinstance(found, _TakeBack):
            return found
        if not found.sources:
            # Nothing intact to copy from yet (primary still uploading, or every
            # copy corrupt): wait with backoff rather than fail.
            raise StoreError(f"no committed region to replicate {job.region} from yet")
        primary = self.r.settings.primary_region.name
        found.sources.sort(key=lambda name: name != primary)
        return found

    async def replicate(self, job: Job) -> None:
        assert job.region is not None
        target = region_store(self.r.stores, job)
        plan = await self._plan(job)
        if plan is None:
            return
        if isinstance(plan, _TakeBack):
            await abort_left_uploads(target, plan.step_prefix)
            await withdraw_then_complete(self.r.sessionmaker, target, plan.keys, job)
            return
        objects, manifest = plan.objects, plan.manifest
        if job.attempts > 1:
            # An earlier attempt killed mid-copy (kill -9, a lost lease) left
            # its multipart uploads open: unseen, billed, for ever. _plan has
            # just checked that no upload or commit from T0 writes into this
            # region, so the step's prefix there is this job's alone.
            await abort_left_uploads(target, plan.step_prefix)
        errors = []
        for name in plan.sources:
            try:
                verified = await self._copy_all(self.r.stores[name], target, objects)
            except SourceCorrupt as exc:
                # The source is bad: try another; the scrubber marks it.
                errors.append(f"{name}: {exc}")
                continue
            await target.put_bytes(plan.manifest_key, manifest)
            deleted = await transaction_giving_way(
                self.r.sessionmaker, partial(self._committed, job, manifest, verified)
            )
            if deleted:
                # Deleted while this copy ran: the deletion may have swept the
                # region before these objects landed.
                keys = [plan.manifest_key, *(o.key for o in objects)]
                await withdraw_then_complete(self.r.sessionmaker, target, keys, job)
                return
            metrics.observe_replication(job.region, sum(o.size for o in objects))
            return
        raise StoreError("every source region failed: " + "; ".join(errors))

    async def _committed(
        self, job: Job, manifest: bytes, verified: bool, session: AsyncSession
    ) -> bool:
        """The region's manifest is written: its replica is committed. True:
        the checkpoint was deleted meanwhile, and nothing is (the job stays)."""
        assert job.region is not None
        checkpoint = await lock_checkpoint(session, job.checkpoint_id)
        assert checkpoint is not None
        if checkpoint.state == CheckpointState.DELETED:
            return True
        await queue.complete(session, job)
        await commit_replica(
            session,
            checkpoint,
            job.region,
            manifest_digest(manifest),
            verified=verified,
            min_regions=self.r.settings.durability.min_regions,
            region_count=len(self.r.settings.regions),
        )
        return False

    async def _copy_all(
        self, source: ObjectStore, target: ObjectStore, objects: list[ObjectEntry]
    ) -> bool:
        """Copy every object; True when every byte was hashed on the way."""
        hashed = True

        async def one(obj: ObjectEntry) -> None:
            nonlocal hashed
            async with self.files:
                if await target.copy_within(source, obj.key, obj.key, obj.size):
                    info = await target.head(obj.key)
                    if info is None or info.size != obj.size:
                        raise StoreError(
                            f"{obj.key}: server-side copy left size {info and info.size}"
                        )
                    hashed = False
                else:
                    await stream_copy(source, target, obj, self.part_size, self.parts)

        await gather_or_cancel(*(one(o) for o in objects))
        return hashed

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        assert job.region is not None
        await replicas.note_error(
            session, job.checkpoint_id, job.region, f"replication failed: {error}"
        )
