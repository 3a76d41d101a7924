"""Checkpoint domain logic: registration, lookups, the validity answer, restore plans."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

from sqlalchemy.ext.asyncio import AsyncSession

from ..db import read_snapshot, reading
from ..draining import DrainState
from ..errors import BadInput, Conflict, NotFound
from ..jobs.kinds import enqueue_delete, enqueue_verify
from ..models import (
    ENDED_STATES,
    PRIORITY,
    Checkpoint,
    CheckpointState,
    PeerCopy,
    ReplicaState,
    Shard,
    utcnow,
)
from ..observability import metrics
from ..peers.plan import peer_sources
from ..peers.repository import copies_of
from ..resources import Resources
from ..storage import layout
from ..storage.chunks import decode as decode_chunks
from ..storage.manifest import shard_fingerprint
from . import detail_in_one, register_timing
from . import repository as repo
from .batch_plan import Outcome, Registration
from .batching import RegistrationBatcher
from .inbox import RegistrationInbox
from .presenter import Listing, checkpoint_out, detail_listing
from .repository import CatalogRow, FileRow
from .scan import ScannedShard, ScanTooLarge, scan
from .schemas import (
    CheckpointOut,
    LineageNode,
    LineageOut,
    PlanFile,
    PlanSource,
    RegisterRequest,
    RestorePlan,
)

# A directory with at most this many entries is listed on the event loop
# (tens of microseconds); a larger one in a worker thread.
INLINE_SCAN_ENTRIES = 64


def fingerprint(shard: ScannedShard, hashes: dict[str, str]) -> str:
    """Identity of a registration's content: same files, sizes, mtimes, hashes."""
    return shard_fingerprint([f.path, f.size, f.mtime_ns, hashes.get(f.path)] for f in shard.files)


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


def _client_hashes(request: RegisterRequest, scanned: ScannedShard) -> dict[str, str]:
    """The client's sha256 of each named file; refuses a file not in the scan."""
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


def registration_of(request: RegisterRequest, scanned: ScannedShard) -> Registration:
    hashes = _client_hashes(request, scanned)
    return Registration(
        request=request, scanned=scanned, hashes=hashes, fingerprint=fingerprint(scanned, hashes)
    )


async def submit_registration(
    resources: Resources, registrations: RegistrationBatcher, request: RegisterRequest
) -> Outcome:
    """Scan and validate one registration, then hand it to the agent's group
    commit; returns once it is committed (or refused)."""
    scanning = time.perf_counter()
    scanned = await scan_checkpoint(resources, request.path)
    scan_seconds = time.perf_counter() - scanning
    outcome = await registrations.submit(registration_of(request, scanned))
    register_timing.report(scan_seconds, outcome.timing)
    return outcome


async def submit_scanned(
    registrations: RegistrationBatcher, request: RegisterRequest, scanned: ScannedShard
) -> Outcome:
    """The group commit of a registration whose files are listed already
    (the memory tier lists a segment that T0 will hold)."""
    return await registrations.submit(registration_of(request, scanned))


async def register(
    resources: Resources,
    registrations: RegistrationBatcher,
    request: RegisterRequest,
    drain: DrainState | None = None,
    inbox: RegistrationInbox | None = None,
) -> tuple[CheckpointOut, bool]:
    """Record a checkpoint shard and enqueue its upload; (record, created).
    While the agent drains (``drain``), only urgent ones (draining.py).

    The scan and every check that needs no catalog happen in the request.
    With an ``inbox`` (``[catalog] register_ack = "recorded"``), a new
    checkpoint is answered once recorded there (inbox.py: the catalog's
    refusals are decided first, its write follows). Otherwise the catalog
    write is the agent's group commit (batching.py): this returns once the
    transaction holding it is committed. Either way a 202 means the
    registration survives a kill -9 of the agent right after it. The hot
    path takes no session of its own: only a checkpoint that existed before
    (another rank, a re-register) is read back.
    """
    if drain is not None:
        drain.admit(request.priority)
    scanning = time.perf_counter()
    scanned = await scan_checkpoint(resources, request.path)
    scan_seconds = time.perf_counter() - scanning
    registration = registration_of(request, scanned)
    if inbox is not None:
        recorded = await inbox.offer(registration)
        if recorded is not None:
            # Counted in the metrics when the writer creates it, as any other.
            register_timing.report_recorded(scan_seconds, time.perf_counter() - scanning)
            return recorded, True
    outcome = await registrations.submit(registration)
    register_timing.report(scan_seconds, outcome.timing)
    if outcome.record is not None:
        return outcome.record, outcome.created
    async with reading(resources.sessionmaker)() as session:
        service = CheckpointService(session, resources)
        return await service.summary(request.run, request.step), outcome.created


@dataclass(frozen=True)
class Detail:
    """The detail view, and the rows the memory tier's lookup reads its
    copies from (T0, the peers' ranks and their copies)."""

    checkpoint: Checkpoint | CatalogRow
    shards: Sequence[Shard | CatalogRow]
    out: CheckpointOut
    peer_copies: Sequence[PeerCopy | CatalogRow]


class CheckpointService:
    def __init__(self, session: AsyncSession, resources: Resources) -> None:
        self.session = session
        self.r = resources
        self.settings = resources.settings

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
        """The detail view: with the files and the checkpoint's jobs."""
        return (await self.detail(run, step)).out

    async def detail(self, run: str, step: int) -> Detail:
        """The detail view and the rows it was made of: the memory tier's
        lookup adds the copies from them without reading them again."""
        if self.r.sync_readers is not None:  # SQLite: one read, on the loop as latest's
            rows = await read_snapshot(
                self.r.inline_readers, self.r.sync_readers, repo.detail_rows, run, step
            )
        else:  # PostgreSQL: one statement on the read pool, not a session's nine
            rows = await self.r.rows.read(detail_in_one.detail_rows, run, step)
        if rows is None:
            # The NotFound that says which is missing (or, registered since,
            # the checkpoint read the other way).
            checkpoint = await self._checkpoint(run, step)
            return await self._detail_of(
                run, checkpoint, with_files=True, with_jobs=True, with_peer_copies=True
            )
        listing = detail_listing(rows, list(self.r.stores))
        return Detail(
            rows.checkpoint,
            rows.shards,
            checkpoint_out(run, rows.checkpoint, listing),
            rows.peer_copies,
        )

    async def summary(self, run: str, step: int) -> CheckpointOut:
        """The checkpoint without its files and jobs (a registration's answer)."""
        checkpoint = await self._checkpoint(run, step)
        return await self.describe(run, checkpoint, with_files=False)

    async def describe_many(self, run: str, checkpoints: list[Checkpoint]) -> list[CheckpointOut]:
        ids = [c.id for c in checkpoints]
        shards = defaultdict(list)
        for shard in await repo.shards_of(self.session, ids):
            shards[shard.checkpoint_id].append(shard)
        replicas = defaultdict(list)
        for replica in await repo.replicas_of(self.session, ids):
            replicas[replica.checkpoint_id].append(replica)
        regions = list(self.r.stores)
        return [
            checkpoint_out(
                run, c, Listing(shards=shards[c.id], replicas=replicas[c.id], regions=regions)
            )
            for c in checkpoints
        ]

    async def describe(
        self, run: str, checkpoint: Checkpoint, *, with_files: bool, with_jobs: bool = False
    ) -> CheckpointOut:
        return (
            await self._detail_of(run, checkpoint, with_files=with_files, with_jobs=with_jobs)
        ).out

    async def _detail_of(
        self,
        run: str,
        checkpoint: Checkpoint,
        *,
        with_files: bool,
        with_jobs: bool,
        with_peer_copies: bool = False,
    ) -> Detail:
        """``checkpoint``'s view, its rows read statement by statement."""
        shards = await repo.shards_of(self.session, [checkpoint.id])
        listing = Listing(
            shards=shards,
            replicas=await repo.replicas_of(self.session, [checkpoint.id]),
            children=await repo.children_of(self.session, run, checkpoint.step),
            files=await repo.file_rows(self.session, checkpoint.id) if with_files else None,
            jobs=await repo.jobs_of(self.session, checkpoint.id) if with_jobs else None,
            regions=list(self.r.stores),
        )
        peer_copies = await copies_of(self.session, [checkpoint.id]) if with_peer_copies else []
        return Detail(checkpoint, shards, checkpoint_out(run, checkpoint, listing), peer_copies)

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
        checkpoint = await self._checkpoint(run, step)
        if checkpoint.state in ENDED_STATES:
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
        self.r.wake()
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
        await enqueue_delete(self.session, checkpoint.id, f"deleted by {who}", force=force)
        await self.session.commit()
        self.r.wake()
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
        self, run: str, step: int, region: str | None, rank: int | None, chunks: bool = False
    ) -> RestorePlan:
        """Sources nearest first: with the peer tier on, the copies live
        agents hold (the shards' T0 copies and their peer copies, this
        agent's first), then the regions holding a committed copy
        (``region`` first, else the primary). A checkpoint not yet durable
        is restorable from those copies when every rank asked for has one."""
        checkpoint = await self._checkpoint(run, step)
        durable = checkpoint.state in (CheckpointState.DURABLE, CheckpointState.REPLICATED)
        if rank is not None and not 0 <= rank < checkpoint.world_size:
            raise BadInput(
                f"rank {rank} is outside world_size {checkpoint.world_size}", code="bad_rank"
            )
        if region is not None and region not in self.r.stores:
            raise BadInput(f"unknown region {region!r}", code="unknown_region")
        files = [
            f for f in await repo.file_rows(self.session, checkpoint.id) if rank in (None, f.rank)
        ]
        hashes = {
            file: (size, list(decode_chunks(joined)))
            for file, (size, joined) in (
                await repo.chunk_hashes(self.session, checkpoint.id) if chunks else {}
            ).items()
        }

        def plan_file(f: FileRow, url: str) -> PlanFile:
            chunk_size, chunk_list = hashes.get((f.rank, f.file_path), (None, None))
            return PlanFile(
                rank=f.rank,
                path=f.file_path,
                size=f.file_size,
                sha256=f.file_sha256 or "",
                url=url,
                chunk_size=chunk_size,
                chunk_sha256=chunk_list,
            )

        sources: list[PlanSource] = []
        # The agents' copies (T0, peers) only with the peer tier on: agents
        # then know each other's URLs (peers/plan.py).
        if self.settings.peers.copies and checkpoint.state not in (
            CheckpointState.FAILED,
            CheckpointState.DELETED,
        ):
            # Only whole ranks: a rank of the checkpoint not registered yet has no files.
            complete = len({f.rank for f in files}) == (
                1 if rank is not None else checkpoint.world_size
            )
            if complete and all(f.file_sha256 for f in files):
                sources += await peer_sources(
                    self.session, self.settings, checkpoint.id, [plan_file(f, "") for f in files]
                )
        if not durable and not sources:
            raise Conflict(
                f"{run} step {step} is {checkpoint.state}, not durable, and no live peer "
                "holds a copy of every rank; wait for it or restore the latest valid checkpoint",
                code="not_durable",
            )
        committed = [
            r.region
            for r in await repo.replicas_of(self.session, [checkpoint.id])
            if durable and r.state == ReplicaState.COMMITTED and r.region in self.r.stores
        ]
        preferred = region or self.settings.primary_region.name
        committed.sort(key=lambda name: (name != preferred, list(self.r.stores).index(name)))
        for name in committed:
            store = self.r.stores[name]
            plan_files = []
            for f in files:
                key = layout.object_key(run, step, f.rank, f.file_path)
                url = await store.presign_get(key)
                if url is None:
                    url = f"/v1/regions/{name}/objects/{quote(key)}"
                plan_files.append(plan_file(f, url))
            sources.append(PlanSource(region=name, files=plan_files))
        if sources:
            metrics.observe_restore_plan(sources[0].region, sum(f.size for f in sources[0].files))
        return RestorePlan(run=run, step=step, world_size=checkpoint.world_size, sources=sources)
