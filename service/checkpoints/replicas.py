"""Catalog access to replicas (a checkpoint's copy in one region): the writes
the job handlers make, and the reads that summarise them.

Each function changes one replica row; the caller holds the transaction and,
when the change can alter the checkpoint's validity (committed, corrupt), the
checkpoint's row lock and calls ``state.refresh_state`` in the same
transaction. Errors are cut to what the column is meant to hold.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from ..db import bound_values, value_params
from ..models import ENDED_STATES, Checkpoint, CheckpointState, Replica, ReplicaState

ERROR_LENGTH = 4000
# Checkpoints whose replicas still count: neither failed nor deleted.
LIVE = tuple(state for state in CheckpointState if state not in ENDED_STATES)


def _one(checkpoint_id: int, region: str) -> Update:
    return update(Replica).where(Replica.checkpoint_id == checkpoint_id, Replica.region == region)


# Built once, bound per call (in the worker's transactions).
_NEEDING_COPY = select(Replica.region).where(
    Replica.checkpoint_id == bindparam("b_id"),
    Replica.state.in_((ReplicaState.PENDING.value, ReplicaState.CORRUPT.value)),
)


@functools.lru_cache(maxsize=8)
def _set_of_one(columns: tuple[str, ...]) -> Update:
    """The UPDATE of one replica (``b_id``, ``b_region``) setting ``columns``
    (bound as ``v_<column>``)."""
    table = cast(Table, Replica.__table__)
    return (
        update(table)
        .where(table.c.checkpoint_id == bindparam("b_id"), table.c.region == bindparam("b_region"))
        .values(bound_values(columns))
    )


async def regions_needing_copy(session: AsyncSession, checkpoint_id: int) -> list[str]:
    """Regions that do not hold the checkpoint yet (pending) or hold a bad copy (corrupt)."""
    return list(await session.scalars(_NEEDING_COPY, {"b_id": checkpoint_id}))


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
    await session.execute(
        _set_of_one(tuple(sorted(values))),
        {"b_id": checkpoint_id, "b_region": region, **value_params(values)},
    )


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
