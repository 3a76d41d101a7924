"""Delete jobs: remove a checkpoint from every region, manifest first.

The catalog says ``deleted`` before any object goes, so ``latest`` never
hands out a checkpoint that is disappearing; in each region the manifest
(the commit marker) goes first, so a half-deleted copy is never taken for a
valid one, by a reader or by a catalog rebuild. An unreachable region only
delays the job.
"""

from __future__ import annotations

import asyncio
import posixpath

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..checkpoints import repository as repo
from ..checkpoints.contents import load_contents
from ..checkpoints.state import lock_checkpoint
from ..concurrency import gather_or_cancel
from ..db import transaction
from ..jobs import queue
from ..jobs.kinds import DeletePayload
from ..jobs.worker import JobHandler
from ..models import Checkpoint, CheckpointState, Job, JobKind, Replica, ReplicaState, utcnow
from ..resources import Resources
from ..storage.base import ObjectStore
from ..storage.leftovers import abort_left_uploads


class DeleteJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.DELETE: JobHandler(run=self.delete, on_failure=self.failed)}

    async def delete(self, job: Job) -> None:
        payload = DeletePayload.from_json(job.payload)
        async with transaction(self.r.sessionmaker) as session:
            checkpoint = await lock_checkpoint(session, job.checkpoint_id)
            if checkpoint is None:
                await queue.complete(session, job)
                return
            if checkpoint.state != CheckpointState.DELETED:
                refusal = await self._refusal(session, checkpoint, payload.force)
                if refusal:
                    # Things changed since the job was queued (a pin, a newer
                    # checkpoint failed): keep it, say why in the job.
                    await queue.complete(session, job)
                    return
                checkpoint.state = CheckpointState.DELETED
                checkpoint.deleted_reason = payload.reason
            contents = await load_contents(session, checkpoint)
            manifest_key = contents.manifest_key(checkpoint)
            keys = [o.key for o in contents.objects]
            sizes = [o.size for o in contents.objects]
            regions = [
                r.region
                for r in await session.scalars(
                    select(Replica).where(
                        Replica.checkpoint_id == checkpoint.id,
                        Replica.state != ReplicaState.DELETED,
                    )
                )
                if r.region in self.r.stores
            ]

        for region in regions:
            await self._delete_in(self.r.stores[region], manifest_key, keys, sizes)
            async with transaction(self.r.sessionmaker) as session:
                await replicas.mark_deleted(session, job.checkpoint_id, region)

        async with transaction(self.r.sessionmaker) as session:
            checkpoint = await lock_checkpoint(session, job.checkpoint_id)
            assert checkpoint is not None
            await queue.complete(session, job)
            checkpoint.deleted_at = utcnow()

    async def _refusal(
        self, session: AsyncSession, checkpoint: Checkpoint, force: bool
    ) -> str | None:
        if checkpoint.pinned:
            return "pinned"
        if not force:
            latest = await repo.latest_valid(
                session, checkpoint.run_id, self.r.settings.durability.min_regions
            )
            if latest is not None and latest.id == checkpoint.id:
                return "latest valid checkpoint"
        return None

    @staticmethod
    async def _delete_in(
        store: ObjectStore, manifest_key: str, keys: list[str], sizes: list[int]
    ) -> None:
        await store.delete(manifest_key)  # the commit marker first
        # Uploads still open under the checkpoint (an upload killed mid-way,
        # or one running now) would otherwise outlive it, unseen and billed;
        # in S3 none can be when every file went up in one PUT.
        if store.may_leave_open(sizes):
            await abort_left_uploads(store, posixpath.dirname(manifest_key) + "/")
        semaphore = asyncio.Semaphore(16)

        async def one(key: str) -> None:
            async with semaphore:
                await store.delete(key)

        await gather_or_cancel(*(one(k) for k in keys))

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        checkpoint = await lock_checkpoint(session, job.checkpoint_id)
        if checkpoint is not None and checkpoint.state == CheckpointState.DELETED:
            checkpoint.error = f"deletion incomplete: {error}"[:4000]
