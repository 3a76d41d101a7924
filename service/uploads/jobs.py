"""Upload and commit jobs: local SSD -> primary region -> MANIFEST.json last."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..checkpoints.contents import load_contents
from ..checkpoints.state import FINAL, commit_replica, lock_checkpoint
from ..concurrency import gather_or_cancel
from ..db import reading, transaction_giving_way
from ..jobs import kinds, queue
from ..jobs.kinds import UploadMode, UploadPayload
from ..jobs.withdraw import withdraw_then_complete
from ..jobs.worker import FollowUps, JobHandler, PermanentJobError, follow_ups, region_store
from ..models import (
    Checkpoint,
    CheckpointState,
    File,
    Job,
    JobKind,
    JobState,
    Replica,
    ReplicaState,
    Shard,
    ShardState,
    priority_of,
    utcnow,
)
from ..observability import metrics
from ..resources import Resources
from ..runs.names import name_of_run
from ..storage import chunks, layout
from ..storage.base import ObjectStore, StoreError
from ..storage.leftovers import abort_left_uploads
from ..storage.manifest import manifest_digest
from .dedup import Deduplicator
from .pipeline import Destination, Outcome, UploadedFile, UploadLimits, upload_file_to
from .source import SourceChanged, SourceFile

log = logging.getLogger("tierckpt.upload")


# The upload's statements of the catalog, built once and bound per call (see
# jobs/queue.py): a checkpoint's uploaded shards, counted; a shard's files;
# what is known of their hashes; the shard marked uploaded.
_FILES_OF_SHARD = select(File).where(File.shard_id == bindparam("b_id"))
_HASHES_OF_SHARD = select(File.id, File.path, File.sha256, File.chunk_sha256).where(
    File.shard_id == bindparam("b_id")
)
_SHARD_UPLOADED = (
    update(Shard)
    .where(Shard.id == bindparam("b_id"), Shard.state != ShardState.UPLOADED.value)
    .values(state=ShardState.UPLOADED.value, uploaded_at=bindparam("b_now"), error=None)
    .execution_options(synchronize_session=False)
)
_UPLOADED_SHARDS = (
    select(func.count())
    .select_from(Shard)
    .where(Shard.checkpoint_id == bindparam("b_id"), Shard.state == ShardState.UPLOADED.value)
)


async def locked(session: AsyncSession, checkpoint_id: int) -> Checkpoint:
    checkpoint = await lock_checkpoint(session, checkpoint_id)
    if checkpoint is None:
        raise PermanentJobError(f"checkpoint {checkpoint_id} no longer exists")
    return checkpoint


async def mark_checkpoint_failed(session: AsyncSession, checkpoint_id: int, reason: str) -> None:
    checkpoint = await locked(session, checkpoint_id)
    if checkpoint.state not in (CheckpointState.REGISTERED, CheckpointState.UPLOADING):
        return
    checkpoint.state = CheckpointState.FAILED
    checkpoint.error = reason


@dataclass(frozen=True)
class _Start:
    """What an upload read from the catalog as it began."""

    run: str
    step: int
    rank: int
    base: Path
    files: list[File]
    fan_outs: list[Job]
    # The checkpoint was deleted: its objects are to be taken back, not sent.
    deleted: bool = False


class HashDisagrees(Exception):
    """Two reads of the same registered file gave different SHA-256s."""


class UploadJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        upload = resources.settings.upload
        self.limits = UploadLimits.of(
            upload.part_size_mb * 1024 * 1024,
            upload.parts_in_flight,
            chunk_size=upload.chunk_size_mb * 1024 * 1024,
        )
        self.files_in_flight = asyncio.Semaphore(upload.files_in_flight)
        # Fan-out jobs whose region got its bytes from the primary's reads:
        # job id -> (the lease token of that claim, its files or why not).
        self._teed: dict[int, tuple[str | None, list[UploadedFile] | Exception]] = {}

    def handlers(self) -> dict[str, JobHandler]:
        return {
            JobKind.UPLOAD: JobHandler(run=self.upload, on_failure=self.upload_failed),
            JobKind.COMMIT: JobHandler(run=self.commit, on_failure=self.commit_failed),
        }

    # -- upload: one shard to the primary region ------------------------------

    async def upload(self, job: Job) -> None:
        assert job.shard_id is not None and job.region is not None
        store = region_store(self.r.stores, job)
        mode = UploadPayload.from_json(job.payload).mode
        repair = mode == UploadMode.REPAIR
        # Sent already by the primary's upload, from the same read (_fan_out);
        # only for this very claim of the job (its lease token).
        teed = self._teed.pop(job.id, None)
        sent_along = teed[1] if teed is not None and teed[0] == job.lease_token else None
        next_jobs = follow_ups()

        async def start(session: AsyncSession) -> _Start | None:
            checkpoint = await locked(session, job.checkpoint_id)
            if checkpoint.state == CheckpointState.FAILED:
                await queue.complete(session, job)
                return None
            run = await name_of_run(session, checkpoint.run_id)
            shard = await session.get_one(Shard, job.shard_id)
            files = list(await session.scalars(_FILES_OF_SHARD, {"b_id": shard.id}))
            base = Path(shard.path)
            if checkpoint.state == CheckpointState.DELETED:
                # An earlier run of this job may have landed objects after the
                # deletion's sweep and been killed before taking them back.
                return _Start(run, checkpoint.step, shard.rank, base, files, [], deleted=True)
            if not repair:
                # A fan-out upload may start after the primary has finished.
                if shard.state == ShardState.REGISTERED:
                    shard.state = ShardState.UPLOADING
                if checkpoint.state == CheckpointState.REGISTERED:
                    checkpoint.state = CheckpointState.UPLOADING
            fan_outs = []
            if mode == UploadMode.PRIMARY:
                fan_outs = await self._fan_out(session, checkpoint, job, next_jobs)
            return _Start(run, checkpoint.step, shard.rank, base, files, fan_outs)

        started = await transaction_giving_way(self.r.sessionmaker, start)
        if started is None:
            return
        run_name, step, rank, base = started.run, started.step, started.rank, started.base
        files, fan_outs = started.files, started.fan_outs
        for fan_out in fan_outs:
            # Run in this task after this job, whatever becomes of it: with
            # the bytes this job sent them, or on their own if it failed.
            assert next_jobs is not None
            next_jobs.add(fan_out)

        sources = [
            SourceFile(
                path=base / f.path,
                relative=f.path,
                key=layout.object_key(run_name, step, rank, f.path),
                size=f.size,
                mtime_ns=f.mtime_ns,
                # A repair must reproduce the hash the catalog already holds.
                expected_sha256=f.expected_sha256 or f.sha256,
                elsewhere=partial(self.r.open_in_memory, base, f.path),
            )
            for f in files
        ]
        if started.deleted:
            await withdraw_then_complete(self.r.sessionmaker, store, [s.key for s in sources], job)
            return
        if isinstance(sent_along, list):
            uploaded = sent_along
        elif isinstance(sent_along, SourceChanged):
            raise PermanentJobError(str(sent_along)) from sent_along
        elif sent_along is not None:
            raise sent_along  # retried on its own, like any failed upload
        else:
            uploaded = await self._send(job, store, sources, fan_outs, run_name, step, rank, repair)
        sent = sum(u.size for u in uploaded if not u.copied)
        metrics.observe_upload(job.region, sent, repair=repair)
        metrics.observe_dedup(job.region, sum(u.size for u in uploaded) - sent)

        by_path = {u.relative: u for u in uploaded}

        async def finish(session: AsyncSession) -> tuple[bool, Job | None]:
            """(deleted meanwhile, the commit job this task claimed)."""
            assert job.region is not None
            checkpoint = await locked(session, job.checkpoint_id)
            if checkpoint.state == CheckpointState.DELETED:
                return True, None
            if repair:
                await queue.complete(session, job)
                await self._commit_repair_when_complete(session, checkpoint, job.region)
                return False, None
            try:
                await _record_hashes(session, job.shard_id, by_path)
            except HashDisagrees as exc:
                raise PermanentJobError(str(exc)) from exc
            await queue.complete(session, job)
            await session.execute(_SHARD_UPLOADED, {"b_id": job.shard_id, "b_now": utcnow()})
            commit_id = await self._enqueue_commit_when_complete(session, checkpoint, job.region)
            if commit_id is None or next_jobs is None:
                return False, None
            # The manifest next, in this task: no trip through the queue
            # between the last byte and the commit marker.
            commit = await queue.claim_queued(
                session, commit_id, owner=next_jobs.owner, lease_seconds=next_jobs.lease_seconds
            )
            return False, commit

        deleted, commit = await transaction_giving_way(self.r.sessionmaker, finish)
        if repair and not deleted:
            return
        if deleted:
            # Deleted while this upload ran: its delete job may have gone
            # through the region before these objects landed. Take them back.
            await withdraw_then_complete(self.r.sessionmaker, store, [s.key for s in sources], job)
            return
        if commit is not None:
            assert next_jobs is not None
            next_jobs.add(commit, first=True)
        self.r.wake()

    async def _send(
        self,
        job: Job,
        store: ObjectStore,
        sources: list[SourceFile],
        fan_outs: list[Job],
        run_name: str,
        step: int,
        rank: int,
        repair: bool,
    ) -> list[UploadedFile]:
        """Send the shard's files to ``store`` and, from the same reads, to
        the regions of ``fan_outs``; what each of those got (its files, or
        why it failed) waits in ``_teed`` for its job to record it."""
        if job.attempts > 1:
            # An earlier attempt may have died mid-upload (kill -9, a lost
            # lease): its open multipart uploads would stay in the region,
            # invisible and billed, forever. This job owns the shard's prefix
            # in this region (one upload job per shard and region).
            await abort_left_uploads(store, layout.shard_prefix(run_name, step, rank))
        roots = self.r.settings.local.roots
        destinations = []
        regions = [(store, job), *((region_store(self.r.stores, j), j) for j in fan_outs)]
        for target, region_job in regions:
            # Unchanged files are copied inside the region instead of sent;
            # not for a repair, which rewrites a damaged copy from T0 by design.
            dedup = (
                await Deduplicator.prepare(
                    self.r.sessionmaker,
                    target,
                    checkpoint_id=region_job.checkpoint_id,
                    run=run_name,
                    rank=rank,
                    chunk_size=self.limits.chunk_size,
                )
                if self.r.settings.upload.dedup and not repair
                else None
            )
            destinations.append(Destination(target, dedup))
        try:
            outcomes = await gather_or_cancel(*(self._one(destinations, s, roots) for s in sources))
        except SourceChanged as exc:
            raise PermanentJobError(str(exc)) from exc
        for number, fan_out in enumerate(fan_outs, start=1):
            got = [per_file[number] for per_file in outcomes]
            failed = next((o for o in got if isinstance(o, Exception)), None)
            files = [o for o in got if isinstance(o, UploadedFile)]
            self._teed[fan_out.id] = (fan_out.lease_token, failed or files)
        return [_uploaded(per_file[0]) for per_file in outcomes]

    async def _fan_out(
        self,
        session: AsyncSession,
        checkpoint: Checkpoint,
        job: Job,
        next_jobs: FollowUps | None,
    ) -> list[Job]:
        """Queue this shard's upload into every secondary region too, from the
        same T0 files, so the regions fill in parallel; the jobs this task
        claimed to send from the primary's own reads (one read and one hash
        of each file for every region), run after it to record their region.

        Only for single-shard checkpoints: a secondary region's manifest needs
        every rank, and ranks of one checkpoint live on different nodes; a
        sharded checkpoint is replicated after the primary commits.
        A fan-out upload that cannot finish falls back to that replicate job.
        """
        settings = self.r.settings
        shard_id = job.shard_id
        if not settings.upload.fan_out or checkpoint.world_size != 1 or shard_id is None:
            return []
        pending = await session.scalars(
            select(Replica.region).where(
                Replica.checkpoint_id == checkpoint.id,
                Replica.state == ReplicaState.PENDING,
                Replica.region != job.region,
            )
        )
        primary = self.r.stores.get(job.region or "")
        claimed = []
        for region in pending:
            store = self.r.stores.get(region)
            # Two buckets of one endpoint: the replicate job's server-side
            # copy sends no bytes at all, which beats a second upload.
            if store is None or (primary is not None and store.copies_server_side_from(primary)):
                continue
            added = await kinds.enqueue_upload(
                session,
                checkpoint.id,
                shard_id=shard_id,
                region=region,
                node=job.node,
                mode=UploadMode.FAN_OUT,
                worker=settings.worker,
                priority=job.priority,
            )
            if added is not None and next_jobs is not None:
                fan_out = await queue.claim_queued(
                    session, added, owner=next_jobs.owner, lease_seconds=next_jobs.lease_seconds
                )
                if fan_out is not None:
                    claimed.append(fan_out)
        return claimed

    async def _one(
        self, destinations: list[Destination], source: SourceFile, roots: list[Path]
    ) -> list[Outcome]:
        async with self.files_in_flight:
            return await upload_file_to(destinations, source, roots, self.limits)

    async def _enqueue_commit_when_complete(
        self, session: AsyncSession, checkpoint: Checkpoint, region: str
    ) -> int | None:
        """The commit job's id when this was the checkpoint's last shard
        (None otherwise, or when it is queued already)."""
        uploaded = await session.scalar(_UPLOADED_SHARDS, {"b_id": checkpoint.id})
        if uploaded == checkpoint.world_size:
            return await kinds.enqueue_commit(
                session,
                checkpoint.id,
                region=region,
                worker=self.r.settings.worker,
                priority=priority_of(checkpoint.priority),
            )
        return None

    async def _commit_repair_when_complete(
        self, session: AsyncSession, checkpoint: Checkpoint, region: str
    ) -> None:
        others = await session.scalar(
            select(func.count())
            .select_from(Job)
            .where(
                Job.checkpoint_id == checkpoint.id,
                Job.kind == JobKind.UPLOAD,
                Job.region == region,
                Job.state.in_((JobState.QUEUED, JobState.RUNNING)),
            )
        )
        if not others:
            await kinds.enqueue_commit(
                session, checkpoint.id, region=region, worker=self.r.settings.worker
            )

    async def upload_failed(self, session: AsyncSession, job: Job, error: str) -> None:
        assert job.region is not None
        mode = UploadPayload.from_json(job.payload).mode
        if mode == UploadMode.REPAIR:
            await replicas.note_error(
                session,
                job.checkpoint_id,
                job.region,
                f"repair from the local copy failed: {error}",
            )
            return
        if mode == UploadMode.FAN_OUT:
            # The region is not lost: it is filled from a committed region
            # instead, by the replicate job that never gives up.
            await self._fall_back_to_replication(session, job, f"upload from T0 failed: {error}")
            return
        if job.shard_id is not None:
            await session.execute(
                update(Shard)
                .where(Shard.id == job.shard_id)
                .values(state=ShardState.FAILED, error=error[:4000])
            )
        await mark_checkpoint_failed(session, job.checkpoint_id, f"upload failed: {error}")
        # A fan-out region may have committed first: the checkpoint is valid,
        # and the primary is then filled from it.
        await self._fall_back_to_replication(session, job, f"upload failed: {error}")

    async def _fall_back_to_replication(self, session: AsyncSession, job: Job, error: str) -> None:
        assert job.region is not None
        await replicas.note_error(session, job.checkpoint_id, job.region, error)
        checkpoint = await locked(session, job.checkpoint_id)
        await kinds.fall_back_to_replication(session, checkpoint, job.region, self.r.stores)

    # -- commit: MANIFEST.json last, then the region counts ------------------

    async def commit(self, job: Job) -> None:
        assert job.region is not None
        store = region_store(self.r.stores, job)
        # The manifest is built from a read snapshot: no write lock (SQLite)
        # is held meanwhile, which a registration would wait for. What may
        # change before the manifest lands (a deletion) is looked at again
        # under the checkpoint's lock below.
        async with reading(self.r.sessionmaker)() as session:
            checkpoint = await session.get(Checkpoint, job.checkpoint_id)
            if checkpoint is None:
                raise PermanentJobError(f"checkpoint {job.checkpoint_id} no longer exists")
            over = checkpoint.state in FINAL
            if over:
                key = layout.manifest_key(
                    await name_of_run(session, checkpoint.run_id), checkpoint.step
                )
            else:
                contents = await load_contents(session, checkpoint)
                if not contents.complete:
                    raise PermanentJobError("commit attempted before every shard was uploaded")
                manifest = contents.manifest(checkpoint, store.key_layout)
                key = contents.manifest_key(checkpoint)
        if over:
            # Deleted: an earlier run of this job may have written the manifest
            # and been killed before taking it back (below).
            deleted = checkpoint.state == CheckpointState.DELETED
            await withdraw_then_complete(self.r.sessionmaker, store, [key] if deleted else [], job)
            return

        try:
            await store.put_bytes(key, manifest)
        except StoreError:
            raise  # retried with backoff by the worker

        async def committed(session: AsyncSession) -> bool:
            """Whether the checkpoint was deleted meanwhile."""
            assert job.region is not None
            checkpoint = await locked(session, job.checkpoint_id)
            # Deleted while the manifest was being written (its delete job may
            # have gone through this region before it landed): no commit
            # marker may outlive the checkpoint (a catalog rebuild reads
            # them), and its replica stays as the deletion left it.
            if checkpoint.state == CheckpointState.DELETED:
                return True
            await queue.complete(session, job)
            await self._committed(session, checkpoint, job.region, manifest)
            return False

        if await transaction_giving_way(self.r.sessionmaker, committed):
            await withdraw_then_complete(self.r.sessionmaker, store, [key], job)

    async def _committed(
        self, session: AsyncSession, checkpoint: Checkpoint, region: str, manifest: bytes
    ) -> None:
        """The region's manifest is written: its replica is committed."""
        await commit_replica(
            session,
            checkpoint,
            region,
            manifest_digest(manifest),
            # The upload hashed what it sent, not what the region holds.
            verified=None,
            min_regions=self.r.settings.durability.min_regions,
            region_count=len(self.r.settings.regions),
        )
        await kinds.enqueue_replication(session, checkpoint, self.r.stores)

    async def commit_failed(self, session: AsyncSession, job: Job, error: str) -> None:
        # A secondary region's commit (after a fan-out upload) does not fail
        # the checkpoint: that region is filled by replication instead.
        if job.region == self.r.settings.primary_region.name:
            await mark_checkpoint_failed(session, job.checkpoint_id, f"commit failed: {error}")
        await self._fall_back_to_replication(session, job, f"commit failed: {error}")


def _uploaded(outcome: Outcome) -> UploadedFile:
    # The primary's failures raise in upload_file_to: only files get here.
    assert isinstance(outcome, UploadedFile)
    return outcome


async def _record_hashes(
    session: AsyncSession, shard_id: int | None, uploaded: dict[str, UploadedFile]
) -> None:
    """Store the SHA-256 (and the chunk hashes) each upload computed; with
    several regions uploading the same T0 files, every later read must agree
    with the first. One statement for all the shard's files (an
    executemany): the transaction holds the catalog's write lock (SQLite),
    which a statement per file would hold for as many round trips as the
    shard has files."""
    files = await session.execute(_HASHES_OF_SHARD, {"b_id": shard_id})
    missing = []
    for file_id, path, known, known_chunks in files:
        upload = uploaded[path]
        digest = upload.sha256
        if known is None or (known == digest and known_chunks is None and upload.chunk_sha256):
            missing.append(
                {
                    "id": file_id,
                    "sha256": digest,
                    "chunk_size": upload.chunk_size,
                    "chunk_sha256": None
                    if upload.chunk_sha256 is None
                    else chunks.encode(upload.chunk_sha256),
                }
            )
        elif known != digest:
            raise HashDisagrees(
                f"{path}: SHA-256 {digest} differs from {known} read earlier; "
                "the file changed after registration"
            )
    if missing:
        await session.execute(update(File), missing)
