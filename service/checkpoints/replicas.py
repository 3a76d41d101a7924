"""Catalog access to replicas (a checkpoint's copy in one region): the writes
the job handlers make, and the reads that summarise them.

Each function changes one replica row; the caller holds the transaction and,
when the change can alter the checkpoint's validity (committed, corrupt), the
checkpoint's row lock and calls ``state.refresh_state`` in the same
transaction. Errors are cut to what the column is meant to hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Update, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Checkpoint, CheckpointState, Replica, ReplicaState

ERROR_LENGTH = 4000
# Checkpoints whose replicas still count: neither failed nor deleted.
_GONE = (CheckpointState.FAILED, CheckpointState.DELETED)
LIVE = tuple(state for state in CheckpointState if state not in _GONE)


def _one(checkpoint_id: int, region: str) -> Update:
    return update(Replica).where(Replica.checkpoint_id == checkpoint_id, Replica.region == region)


async def regions_needing_copy(session: AsyncSession, checkpoint_id: int) -> list[str]:
    """Regions that do not hold the checkpoint yet (pending) or hold a bad copy (corrupt)."""
    rows = await session.scalars(
        select(Replica.region).where(
            Replica.checkpoint_id == checkpoint_id,
            Replica.state.in_((ReplicaState.PENDING, ReplicaState.CORRUPT)),
        )
    )
    return list(rows)


async def note_error(session: AsyncSession, checkpoint_id: int, region: str, error: str) -> None:
    """Say why the region's copy is not (yet) what it should be; its state stays."""
    await session.execute(_one(checkpoint_id, region).values(error=error[:ERROR_LENGTH]))


async def mark_committed(
    session: AsyncSession,
    checkpoint_id: int,
    region: str,
    manifest_sha256: str,
    *,
    verified: bool | None,
    now: datetime,
) -> None:
    """The region's manifest is written. ``verified``: every byte was hashed on
    the way (True), the copy was not (False: any earlier verification no
    longer holds), or nothing is said (None: ``verified_at`` is left alone)."""
    values: dict[str, object] = {
        "state": ReplicaState.COMMITTED,
        "manifest_sha256": manifest_sha256,
        "committed_at": now,
        "error": None,
    }
    if verified is not None:
        values["verified_at"] = now if verified else None
    await session.execute(_one(checkpoint_id, region).values(**values))


async def mark_verified(
    session: AsyncSession,
    checkpoint_id: int,
    region: str,
    state: ReplicaState,
    *,
    now: datetime,
    error: str | None,
) -> None:
    """A verification read the region's copy: intact (committed) or corrupt (with why)."""
    await session.execute(
        _one(checkpoint_id, region).values(
            state=state, verified_at=now, error=error[:ERROR_LENGTH] if error else None
        )
    )


async def mark_deleted(session: AsyncSession, checkpoint_id: int, region: str) -> None:
    """The region's objects are gone."""
    await session.execute(
        _one(checkpoint_id, region).values(state=ReplicaState.DELETED, error=None)
    )


async def totals(session: AsyncSession) -> Sequence[Any]:
    """(region, state, count, bytes, oldest durable_at) over live checkpoints'
    replicas: what the dashboard and the metrics show per region."""
    rows = await session.execute(
        select(
            Replica.region,
            Replica.state,
            func.count(),
            func.sum(Checkpoint.total_bytes),
            func.min(Checkpoint.durable_at),
        )
        .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
        .where(Checkpoint.state.in_(LIVE))
        .group_by(Replica.region, Replica.state)
    )
    return rows.all()
