"""Checkpoint domain logic: registration, lookups, the validity answer, restore plans."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import defaultdict
from urllib.parse import quote

from sqlalchemy.ext.asyncio import AsyncSession

from ..errors import BadInput, Conflict, NotFound
from ..models import (
    PRIORITY,
    Checkpoint,
    CheckpointState,
    Replica,
    ReplicaState,
    Shard,
    utcnow,
)
from ..observability import metrics
from ..resources import Resources
from ..storage import layout
from . import repository as repo
from .batching import Outcome, Registration, batcher_for
from .scan import ScannedShard, ScanTooLarge, scan
from .schemas import (
    CheckpointOut,
    FileOut,
    JobOut,
    LineageNode,
    LineageOut,
    PlanFile,
    PlanSource,
    RefOut,
    RegisterRequest,
    ReplicaOut,
    RestorePlan,
    ShardOut,
)
from .state import replication_lag

# A directory with at most this many entries is listed on the event loop
# (tens of microseconds); a larger one in a worker thread.
INLINE_SCAN_ENTRIES = 64


def fingerprint(shard: ScannedShard, hashes: dict[str, str]) -> str:
    """Identity of a registration's content: same files, sizes, mtimes, hashes."""
    entries = [[f.path, f.size, f.mtime_ns, hashes.get(f.path)] for f in shard.files]
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


async def scan_checkpoint(resources: Resources, path: str) -> ScannedShard:
    """List the checkpoint: inline when small (no thread hop), else in a thread."""
    local = resources.settings.local
    try:
        return scan(
            path,
            local.roots,
            max_files=local.max_files_per_checkpoint,
            max_path_length=local.max_path_length,
            max_entries=INLINE_SCAN_ENTRIES,
        )
    except ScanTooLarge:
        return await asyncio.to_thread(
            scan,
            path,
            local.roots,
            max_files=local.max_files_per_checkpoint,
            max_path_length=local.max_path_length,
        )


async def submit_registration(resources: Resources, request: RegisterRequest) -> Outcome:
    """Scan and validate one registration, then hand it to the agent's group
    commit; returns once it is committed (or refused)."""
    scanned = await scan_checkpoint(resources, request.path)
    hashes = CheckpointService._client_hashes(request, scanned)
    registration = Registration(
        request=request, scanned=scanned, hashes=hashes, fingerprint=fingerprint(scanned, hashes)
    )
    return await batcher_for(resources).submit(registration)


class CheckpointService:
    def __init__(self, session: AsyncSession, resources: Resources) -> None:
        self.session = session
        self.r = resources
        self.settings = resources.settings

    # -- register ------------------------------------------------------------

    async def register(self, request: RegisterRequest) -> tuple[CheckpointOut, bool]:
        """Record a checkpoint shard and enqueue its upload; (record, created).

        The scan and every check that needs no catalog happen in the request;
        the catalog write is the agent's group commit (batching.py): this
        returns once the transaction holding it is committed, so a 202 means
        the registration survives a kill -9 of the agent right after it.
        """
        outcome = await submit_registration(self.r, request)
        return await self.registered(request, outcome), outcome.created

    async def registered(self, request: RegisterRequest, outcome: Outcome) -> CheckpointOut:
        """The answer to a committed registration."""
        if outcome.record is not None:
            return outcome.record
        # The checkpoint existed before this batch (another rank, a re-register).
        checkpoint = await self._checkpoint(request.run, request.step)
        return await self.describe(request.run, checkpoint, with_files=False)

    @staticmethod
    def _client_hashes(request: RegisterRequest, scanned: ScannedShard) -> dict[str, str]:
        if not request.files:
            return {}
        known = {f.path for f in scanned.files}
        hashes: dict[str, str] = {}
        for entry in request.files:
            path = entry.path.strip("/")
            if path not in known:
                raise BadInput(
                    f"files[].path {entry.path!r} is not a file of {request.path}",
                    code="unknown_file",
                )
            hashes[path] = entry.sha256.lower()
        return hashes

    # -- reads ---------------------------------------------------------------

    async def _run_id(self, run: str) -> int:
        found = await repo.find_run(self.session, run)
        if found is None:
            raise NotFound(f"run {run!r} has no checkpoints", code="run_not_found")
        return found.id

    async def _checkpoint(self, run: str, step: int) -> Checkpoint:
        checkpoint = await repo.find_checkpoint(self.session, await self._run_id(run), step)
        if checkpoint is None:
            raise NotFound(
                f"run {run!r} has no checkpoint at step {step}", code="checkpoint_not_found"
            )
        return checkpoint

    async def get(self, run: str, step: int) -> CheckpointOut:
        checkpoint = await self._checkpoint(run, step)
        out = await self.describe(run, checkpoint, with_files=True)
        out.jobs = [
            JobOut(
                kind=job.kind,
                state=job.state,
                region=job.region,
                rank=rank,
                attempts=job.attempts,
                last_error=job.last_error,
            )
            for job, rank in await repo.jobs_of(self.session, checkpoint.id)
        ]
        return out

    async def describe_many(self, run: str, checkpoints: list[Checkpoint]) -> list[CheckpointOut]:
        ids = [c.id for c in checkpoints]
        shards = defaultdict(list)
        for shard in await repo.shards_of(self.session, ids):
            shards[shard.checkpoint_id].append(shard)
        replicas = defaultdict(list)
        for replica in await repo.replicas_of(self.session, ids):
            replicas[replica.checkpoint_id].append(replica)
        return [
            self._to_out(run, c, shards[c.id], replicas[c.id], children=[], files=None)
            for c in checkpoints
        ]

    async def describe(
        self, run: str, checkpoint: Checkpoint, *, with_files: bool
    ) -> CheckpointOut:
        shards = await repo.shards_of(self.session, [checkpoint.id])
        replicas = await repo.replicas_of(self.session, [checkpoint.id])
        children = await repo.children_of(self.session, run, checkpoint.step)
        files = None
        if with_files:
            files = [
                FileOut(rank=rank, path=f.path, size=f.size, sha256=f.sha256)
                for rank, f in await repo.files_of(self.session, checkpoint.id)
            ]
        return self._to_out(run, checkpoint, shards, replicas, children, files)

    def _to_out(
        self,
        run: str,
        c: Checkpoint,
        shards: list[Shard],
        replicas: list[Replica],
        children: list[tuple[str, int]],
        files: list[FileOut] | None,
    ) -> CheckpointOut:
        order = {name: i for i, name in enumerate(self.r.stores)}
        return CheckpointOut(
            run=run,
            step=c.step,
            state=c.state,
            world_size=c.world_size,
            epoch=c.epoch,
            priority=c.priority,
            metrics=c.metrics,
            metadata=c.meta,
            parent=RefOut(run=c.parent_run, step=c.parent_step)
            if c.parent_run is not None and c.parent_step is not None
            else None,
            children=[RefOut(run=name, step=step) for name, step in children],
            created_at=c.created_at,
            durable_at=c.durable_at,
            error=c.error,
            total_bytes=c.total_bytes,
            file_count=c.file_count,
            write_seconds=c.write_seconds,
            pinned=c.pinned,
            quarantined_at=c.quarantined_at,
            quarantine_reason=c.quarantine_reason,
            deleted_at=c.deleted_at,
            deleted_reason=c.deleted_reason,
            shards=[
                ShardOut(rank=s.rank, node=s.node, path=s.path, state=s.state, error=s.error)
                for s in shards
            ],
            files=files,
            replicas=[
                ReplicaOut(
                    region=r.region,
                    state=r.state,
                    uri=r.uri,
                    verified_at=r.verified_at,
                    committed_at=r.committed_at,
                    error=r.error,
                    lag_seconds=replication_lag(c, r),
                )
                for r in sorted(replicas, key=lambda r: order.get(r.region, len(order)))
            ],
        )

    async def list(
        self,
        run: str,
        *,
        states: list[str] | None,
        min_step: int | None,
        max_step: int | None,
        limit: int,
        offset: int,
        pinned: bool | None = None,
    ) -> tuple[list[CheckpointOut], int]:
        page, total = await repo.list_checkpoints(
            self.session,
            await self._run_id(run),
            states=states,
            min_step=min_step,
            max_step=max_step,
            limit=limit,
            offset=offset,
            pinned=pinned,
        )
        return await self.describe_many(run, page), total

    async def verify(self, run: str, step: int) -> CheckpointOut:
        """Queue a re-read and re-hash of every copy of the checkpoint."""
        from ..integrity.jobs import enqueue_verify

        checkpoint = await self._checkpoint(run, step)
        if checkpoint.state in (CheckpointState.FAILED, CheckpointState.DELETED):
            raise Conflict(
                f"{run} step {step} is {checkpoint.state}; nothing to verify", code="not_verifiable"
            )
        replicas = await repo.replicas_of(self.session, [checkpoint.id])
        targets = [
            r.region
            for r in replicas
            if r.state in (ReplicaState.COMMITTED, ReplicaState.CORRUPT)
            and r.region in self.r.stores
        ]
        if not targets:
            raise Conflict(
                f"{run} step {step} has no committed copy yet; wait until it is durable",
                code="not_durable",
            )
        for region in targets:
            # Asked for by a person: ahead of the scrubber's background work.
            await enqueue_verify(self.session, checkpoint.id, region, priority=PRIORITY["urgent"])
        await self.session.commit()
        self.r.wake_worker()
        return await self.get(run, step)

    # -- curation: pins, quarantine, deletion, lineage -----------------------

    async def set_pinned(self, run: str, step: int, pinned: bool) -> CheckpointOut:
        checkpoint = await self._checkpoint(run, step)
        if pinned and checkpoint.state == CheckpointState.DELETED:
            raise Conflict(f"{run} step {step} is deleted; it cannot be pinned", code="deleted")
        checkpoint.pinned = pinned
        await self.session.commit()
        return await self.get(run, step)

    async def quarantine(self, run: str, step: int, reason: str | None) -> CheckpointOut:
        checkpoint = await self._checkpoint(run, step)
        checkpoint.quarantined_at = utcnow() if reason is not None else None
        checkpoint.quarantine_reason = reason
        await self.session.commit()
        return await self.get(run, step)

    async def delete(self, run: str, step: int, who: str, force: bool) -> CheckpointOut:
        from ..retention.service import enqueue_delete

        checkpoint = await self._checkpoint(run, step)
        if checkpoint.pinned:
            raise Conflict(f"{run} step {step} is pinned; unpin it first", code="pinned")
        if checkpoint.state == CheckpointState.DELETED:
            return await self.get(run, step)
        latest = await repo.latest_valid(
            self.session, checkpoint.run_id, self.settings.durability.min_regions
        )
        if latest is not None and latest.id == checkpoint.id and not force:
            raise Conflict(
                f"{run} step {step} is the latest valid checkpoint; pass force=true to delete it",
                code="latest_valid",
            )
        await enqueue_delete(self.session, checkpoint, f"deleted by {who}", force=force)
        await self.session.commit()
        self.r.wake_worker()
        return await self.get(run, step)

    async def lineage(self, run: str, step: int) -> LineageOut:
        checkpoint = await self._checkpoint(run, step)
        ancestors: list[LineageNode] = []
        seen = {(run, step)}
        parent = (checkpoint.parent_run, checkpoint.parent_step)
        while parent[0] is not None and parent[1] is not None and len(ancestors) < 10_000:
            if parent in seen:
                break  # a cycle in user-given parents: stop, do not loop
            seen.add((parent[0], parent[1]))
            found = await self._find(parent[0], parent[1])
            if found is None:
                ancestors.append(LineageNode(run=parent[0], step=parent[1], state=None))
                break
            ancestors.append(self._node(parent[0], found))
            parent = (found.parent_run, found.parent_step)
        children = []
        for child_run, child_step in await repo.children_of(self.session, run, step):
            found = await self._find(child_run, child_step)
            if found is not None:
                children.append(self._node(child_run, found))
        return LineageOut(
            checkpoint=self._node(run, checkpoint), ancestors=ancestors, children=children
        )

    async def _find(self, run: str, step: int) -> Checkpoint | None:
        run_row = await repo.find_run(self.session, run)
        return (
            None if run_row is None else await repo.find_checkpoint(self.session, run_row.id, step)
        )

    @staticmethod
    def _node(run: str, checkpoint: Checkpoint) -> LineageNode:
        return LineageNode(
            run=run,
            step=checkpoint.step,
            state=checkpoint.state,
            created_at=checkpoint.created_at,
            metrics=checkpoint.metrics or {},
        )

    # -- restore plan --------------------------------------------------------

    async def restore_plan(
        self, run: str, step: int, region: str | None, rank: int | None
    ) -> RestorePlan:
        checkpoint = await self._checkpoint(run, step)
        if checkpoint.state not in (CheckpointState.DURABLE, CheckpointState.REPLICATED):
            raise Conflict(
                f"{run} step {step} is {checkpoint.state}, not durable; wait for it or restore "
                "the latest valid checkpoint",
                code="not_durable",
            )
        if rank is not None and not 0 <= rank < checkpoint.world_size:
            raise BadInput(
                f"rank {rank} is outside world_size {checkpoint.world_size}", code="bad_rank"
            )
        if region is not None and region not in self.r.stores:
            raise BadInput(f"unknown region {region!r}", code="unknown_region")
        files = [
            (r, f) for r, f in await repo.files_of(self.session, checkpoint.id) if rank in (None, r)
        ]
        committed = [
            r.region
            for r in await repo.replicas_of(self.session, [checkpoint.id])
            if r.state == ReplicaState.COMMITTED and r.region in self.r.stores
        ]
        preferred = region or self.settings.primary_region.name
        committed.sort(key=lambda name: (name != preferred, list(self.r.stores).index(name)))
        sources = []
        for name in committed:
            store = self.r.stores[name]
            plan_files = []
            for file_rank, f in files:
                key = layout.object_key(run, step, file_rank, f.path)
                url = await store.presign_get(key)
                if url is None:
                    url = f"/v1/regions/{name}/objects/{quote(key)}"
                plan_files.append(
                    PlanFile(
                        rank=file_rank, path=f.path, size=f.size, sha256=f.sha256 or "", url=url
                    )
                )
            sources.append(PlanSource(region=name, files=plan_files))
        if sources:
            metrics.observe_restore_plan(sources[0].region, sum(f.size for f in sources[0].files))
        return RestorePlan(run=run, step=step, world_size=checkpoint.world_size, sources=sources)
