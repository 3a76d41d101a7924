"""The validity rule, as one function over the catalog.

A checkpoint is valid when every shard of its world_size is uploaded and
hashed and at least ``min_regions`` regions hold a committed manifest and no
replica it relies on is corrupt. ``refresh_state`` derives the checkpoint's
state from its replicas; call it (with the checkpoint row locked) in every
transaction that changes a replica.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..jobs import kinds, queue
from ..models import ENDED_STATES, Checkpoint, CheckpointState, Replica, ReplicaState, utcnow
from . import replicas

# States nothing brings back: failed (never became valid) and deleted.
FINAL = ENDED_STATES


# Built once, bound per call (in the worker's every transaction).
_LOCK = select(Checkpoint).where(Checkpoint.id == bindparam("b_id")).with_for_update()
_COMMITTED = (
    select(func.count())
    .select_from(Replica)
    .where(
        Replica.checkpoint_id == bindparam("b_id"),
        Replica.state == ReplicaState.COMMITTED.value,
    )
)


async def lock_checkpoint(session: AsyncSession, checkpoint_id: int) -> Checkpoint | None:
    """Serialise every state change of one checkpoint across agents."""
    return await session.scalar(_LOCK, {"b_id": checkpoint_id})


async def refresh_state(
    session: AsyncSession, checkpoint: Checkpoint, min_regions: int, region_count: int
) -> bool:
    """True when this made the checkpoint valid for the first time."""
    if checkpoint.state in FINAL:
        return False
    first_valid = False
    committed = await session.scalar(_COMMITTED, {"b_id": checkpoint.id}) or 0
    if committed >= min_regions:
        if checkpoint.durable_at is None:
            checkpoint.durable_at = utcnow()
            first_valid = True
        checkpoint.state = (
            CheckpointState.REPLICATED
            if region_count > 1 and committed >= region_count
            else CheckpointState.DURABLE
        )
        if checkpoint.error and checkpoint.error.startswith("no intact copy"):
            checkpoint.error = None
    elif checkpoint.durable_at is not None:
        # It was valid once; too few good copies are left now.
        checkpoint.state = CheckpointState.CORRUPT
        checkpoint.error = (
            f"no intact copy in enough regions ({committed} of {min_regions} needed); "
            "repair scheduled where a good source exists"
        )
    return first_valid


async def commit_replica(
    session: AsyncSession,
    checkpoint: Checkpoint,
    region: str,
    manifest_sha256: str,
    *,
    verified: bool | None,
    min_regions: int,
    region_count: int,
) -> None:
    """The region's manifest is written: its replica is committed, and the
    checkpoint's state follows. ``verified``: every byte was hashed on the way
    (True), the copy was not (False: any earlier verification no longer
    holds), or nothing is said (None). The checkpoint row must be locked.
    A replicate job still queued into the region is done with it. A
    checkpoint that becomes durable here has its run's retention applied
    now (a retain job), not at the next periodic sweep."""
    await replicas.mark_committed(
        session, checkpoint.id, region, manifest_sha256, verified=verified, now=utcnow()
    )
    await queue.replication_done(session, checkpoint.id, region)
    if await refresh_state(session, checkpoint, min_regions, region_count):
        await kinds.enqueue_retention(session, checkpoint)


class _Durable(Protocol):
    @property
    def durable_at(self) -> datetime | None: ...


class _Committed(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def committed_at(self) -> datetime | None: ...


def replication_lag(checkpoint: _Durable, replica: _Committed) -> float | None:
    """How long a replica took to commit after the first durable copy, or
    (still pending) how long it has been waiting; ORM objects or rows."""
    if checkpoint.durable_at is None:
        return None
    if replica.state == ReplicaState.COMMITTED and replica.committed_at is not None:
        return max(0.0, (replica.committed_at - checkpoint.durable_at).total_seconds())
    if replica.state == ReplicaState.PENDING:
        return (utcnow() - checkpoint.durable_at).total_seconds()
    return None
