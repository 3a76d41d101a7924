"""Queries of the peer tier that several modules share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Checkpoint, PeerCopy, PeerCopyState, Run, Shard


async def copies_of(session: AsyncSession, checkpoint_ids: Sequence[int]) -> list[PeerCopy]:
    if not checkpoint_ids:
        return []
    return list(
        await session.scalars(
            select(PeerCopy)
            .where(PeerCopy.checkpoint_id.in_(checkpoint_ids))
            .order_by(PeerCopy.node, PeerCopy.shard_id)
        )
    )


async def held_here(session: AsyncSession, node: str) -> Sequence[Any]:
    """This node's committed peer copies: (copy, shard node, shard path,
    shard state, checkpoint id, step, checkpoint state, run name)."""
    result = await session.execute(
        select(
            PeerCopy,
            Shard.node,
            Shard.path,
            Shard.state,
            Checkpoint.id,
            Checkpoint.step,
            Checkpoint.state,
            Run.name,
        )
        .join(Shard, Shard.id == PeerCopy.shard_id)
        .join(Checkpoint, Checkpoint.id == PeerCopy.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(PeerCopy.node == node, PeerCopy.state == PeerCopyState.COMMITTED)
    )
    return result.all()
