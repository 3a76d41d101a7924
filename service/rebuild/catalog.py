"""Step 3 of a rebuild: write one checkpoint's findings into the catalog.

- ``create``: a checkpoint the catalog does not hold. Everything comes from
  the winning manifest: run, checkpoint, one shard per rank, files, and one
  replica per configured region: ``committed`` where every object verified,
  ``corrupt`` (the error names the bad objects) where not, ``pending`` where
  the region has no usable manifest, could not be read or was unreachable.
  The T0 copy is unknown after a disaster: each shard is recorded on node
  ``REBUILT_NODE`` (no agent has that name, so no local copy is ever
  offered) with path ``""``, state ``uploaded``; files have ``mtime_ns`` 0
  and ``sha256`` = ``expected_sha256`` = the verified hash. With at least
  one verified copy but fewer than ``min_regions`` the checkpoint is
  ``uploading`` (replication completes it); with none it is ``corrupt``
  ("no intact copy ...", cleared by ``refresh_state`` once enough copies
  commit).
- ``fill``: a checkpoint the catalog already holds keeps its checkpoint,
  shard and file rows. Only replicas that are missing or still ``pending``
  may change, judged against the catalog's hashes, and only a fully
  verified one becomes committed.

Both queue replicate jobs for pending/corrupt replicas when an intact copy
exists elsewhere (deduplicated by the queue, so a second rebuild adds none).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import repository as repo
from ..checkpoints.state import FINAL, refresh_state
from ..jobs import kinds
from ..models import (
    Checkpoint,
    CheckpointState,
    File,
    Replica,
    ReplicaState,
    Shard,
    ShardState,
    utcnow,
)
from ..storage import chunks, layout
from ..storage.base import ObjectInfo
from ..storage.manifest import Content, ObjectEntry, shard_fingerprint
from .check import RegionCheck, judge
from .context import Context
from .report import CORRUPT, VERIFIED, CheckpointResult, RegionResult

REBUILT_NODE = "rebuilt"


@dataclass(frozen=True)
class Known:
    state: str
    replicas: dict[str, str]


async def known_checkpoint(session: AsyncSession, run: str, step: int) -> Known | None:
    """The state and replica states of (run, step), if the catalog holds it."""
    run_row = await repo.find_run(session, run)
    if run_row is None:
        return None
    checkpoint = await repo.find_checkpoint(session, run_row.id, step)
    if checkpoint is None:
        return None
    replicas = await session.scalars(select(Replica).where(Replica.checkpoint_id == checkpoint.id))
    return Known(checkpoint.state, {r.region: r.state for r in replicas})


async def _catalog_content(
    session: AsyncSession, checkpoint: Checkpoint, run: str
) -> Content | None:
    """The catalog's own (world_size, files) when every shard is uploaded and hashed."""
    shards = await repo.shards_of(session, [checkpoint.id])
    if len(shards) != checkpoint.world_size or any(s.state != ShardState.UPLOADED for s in shards):
        return None
    files = await repo.files_of(session, checkpoint.id)
    if any(f.sha256 is None for _rank, f in files):
        return None
    return (
        checkpoint.world_size,
        tuple(
            sorted(
                ObjectEntry.of(run, checkpoint.step, rank, f.path, f.size, f.sha256 or "")
                for rank, f in files
            )
        ),
    )


def _replica_state(status: str) -> ReplicaState:
    if status == VERIFIED:
        return ReplicaState.COMMITTED
    if status == CORRUPT:
        return ReplicaState.CORRUPT
    return ReplicaState.PENDING


def _new_replica(
    checkpoint_id: int,
    region: str,
    uri: str,
    state: ReplicaState,
    check: RegionCheck | None,
    error: str | None,
    now: datetime,
) -> Replica:
    committed = state == ReplicaState.COMMITTED
    return Replica(
        checkpoint_id=checkpoint_id,
        region=region,
        state=state,
        uri=uri,
        manifest_sha256=check.manifest.digest if committed and check and check.manifest else None,
        error=None if committed else error,
        committed_at=now if committed else None,
        verified_at=now if committed else None,
    )


async def _enqueue_repairs(
    session: AsyncSession, ctx: Context, checkpoint: Checkpoint, states: dict[str, str]
) -> int:
    """Replicate jobs for pending/corrupt replicas, when an intact copy exists."""
    if checkpoint.state in FINAL or ReplicaState.COMMITTED not in states.values():
        return 0
    added = 0
    for region, state in states.items():
        if state in (ReplicaState.PENDING, ReplicaState.CORRUPT) and region in ctx.stores:
            added += await kinds.enqueue_replicate(session, checkpoint, region)
    return added


async def create(
    session: AsyncSession,
    ctx: Context,
    run_id: int,
    run: str,
    step: int,
    winner: str,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult:
    """A checkpoint the catalog does not hold: everything from the manifest
    of region ``winner`` (see ``check.choose_manifest``)."""
    canonical = checks[winner].manifest
    assert canonical is not None
    checkpoint = Checkpoint(
        run_id=run_id,
        step=step,
        state=CheckpointState.REGISTERED,
        world_size=canonical.world_size,
        epoch=canonical.epoch,
        priority="normal",
        metrics=canonical.metrics,
        meta=canonical.metadata,
        parent_run=canonical.parent[0] if canonical.parent else None,
        parent_step=canonical.parent[1] if canonical.parent else None,
        total_bytes=sum(e.size for e in canonical.files),
        file_count=len(canonical.files),
        created_at=canonical.created_at,
    )
    session.add(checkpoint)
    await session.flush()
    now = utcnow()
    by_rank: dict[int, list[ObjectEntry]] = defaultdict(list)
    for entry in canonical.files:
        by_rank[entry.rank].append(entry)
    shards = [
        Shard(
            checkpoint_id=checkpoint.id,
            rank=rank,
            node=REBUILT_NODE,
            path="",
            state=ShardState.UPLOADED,
            fingerprint=shard_fingerprint(
                [e.path, e.size, e.sha256] for e in sorted(by_rank[rank])
            ),
            uploaded_at=now,
        )
        for rank in range(canonical.world_size)
    ]
    session.add_all(shards)
    await session.flush()
    if canonical.files:
        await session.execute(
            insert(File),
            [
                {
                    "shard_id": shards[e.rank].id,
                    "path": e.path,
                    "size": e.size,
                    "mtime_ns": 0,
                    "expected_sha256": e.sha256,
                    "sha256": e.sha256,
                    "chunk_size": e.chunk_size,
                    "chunk_sha256": None
                    if e.chunk_sha256 is None
                    else chunks.encode(e.chunk_sha256),
                }
                for e in canonical.files
            ],
        )

    verified = checks[winner].verification
    against = f"region {winner}'s{' verified' if verified and verified.ok else ''} manifest"
    results: dict[str, RegionResult] = {}
    states: dict[str, str] = {}
    prefix = layout.step_prefix(run, step)
    for name, store in ctx.stores.items():
        check = checks.get(name)
        if check is None:
            status, error = ctx.status_unchecked(name, found), None
        else:
            status, error = judge(check, canonical.content, against)
        state = _replica_state(status)
        session.add(_new_replica(checkpoint.id, name, store.uri(prefix), state, check, error, now))
        states[name] = state
        results[name] = RegionResult(status=status, replica=state, error=error)
    await session.flush()

    settings = ctx.settings
    await refresh_state(session, checkpoint, settings.durability.min_regions, len(settings.regions))
    committed_count = sum(1 for s in states.values() if s == ReplicaState.COMMITTED)
    if checkpoint.state == CheckpointState.REGISTERED:
        if committed_count:
            # Valid once replication brings it to min_regions.
            checkpoint.state = CheckpointState.UPLOADING
        else:
            checkpoint.state = CheckpointState.CORRUPT
            checkpoint.error = (
                "no intact copy in any region at catalog rebuild ("
                + ", ".join(f"{n}: {r.status}" for n, r in results.items())
                + ")"
            )
    jobs = await _enqueue_repairs(session, ctx, checkpoint, states)
    return _result(run, checkpoint, "created", results, jobs)


async def fill(
    session: AsyncSession,
    ctx: Context,
    checkpoint: Checkpoint,
    run: str,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult:
    """A checkpoint the catalog already holds: only missing or pending
    replicas may change, and only to what verifies against the catalog."""
    step = checkpoint.step
    replicas = {
        r.region: r
        for r in await session.scalars(
            select(Replica).where(Replica.checkpoint_id == checkpoint.id)
        )
    }
    final = checkpoint.state in FINAL
    expected = None if final else await _catalog_content(session, checkpoint, run)
    now = utcnow()
    prefix = layout.step_prefix(run, step)
    results: dict[str, RegionResult] = {}
    states: dict[str, str] = {}
    changed = False
    for name, store in ctx.stores.items():
        check = checks.get(name)
        replica = replicas.get(name)
        if final or check is None:
            status, error = ctx.status_unchecked(name, found), None
        else:
            status, error = judge(check, expected, "the catalog")
        manifest = check.manifest if check else None
        if final:
            pass
        elif replica is None:
            replica = _new_replica(
                checkpoint.id, name, store.uri(prefix), _replica_state(status), check, error, now
            )
            session.add(replica)
            changed = True
        elif replica.state == ReplicaState.PENDING and status == VERIFIED and manifest:
            replica.state = ReplicaState.COMMITTED
            replica.manifest_sha256 = manifest.digest
            replica.committed_at = now
            replica.verified_at = now
            replica.error = None
            changed = True
        if replica is not None:
            states[name] = replica.state
        results[name] = RegionResult(
            status=status, replica=replica.state if replica else None, error=error
        )
    if changed:
        await session.flush()
        settings = ctx.settings
        await refresh_state(
            session, checkpoint, settings.durability.min_regions, len(settings.regions)
        )
    jobs = 0 if final else await _enqueue_repairs(session, ctx, checkpoint, states)
    return _result(run, checkpoint, "updated" if changed else "unchanged", results, jobs)


def _result(
    run: str, checkpoint: Checkpoint, action: str, regions: dict[str, RegionResult], jobs: int
) -> CheckpointResult:
    return CheckpointResult(
        run=run,
        step=checkpoint.step,
        action=action,
        state=checkpoint.state,
        world_size=checkpoint.world_size,
        file_count=checkpoint.file_count,
        total_bytes=checkpoint.total_bytes,
        regions=regions,
        jobs_enqueued=jobs,
        error=checkpoint.error,
    )
