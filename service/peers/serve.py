"""Which directory of this node holds a shard's bytes for a restore: its
committed peer copy, or the shard's own T0 copy when this is its node and
T0 retention has not evicted it (a restore on the node, or a restart on a
replacement node reading from here)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from ..db import reading
from ..errors import NotFound
from ..models import PeerCopy, PeerCopyState, Shard
from ..resources import Resources


async def copy_path(resources: Resources, shard_id: int) -> Path:
    node = resources.settings.server.node
    async with reading(resources.read_sessionmaker or resources.sessionmaker)() as session:
        path = await session.scalar(
            select(PeerCopy.path).where(
                PeerCopy.shard_id == shard_id,
                PeerCopy.node == node,
                PeerCopy.state == PeerCopyState.COMMITTED,
            )
        )
        if not path:
            path = await session.scalar(
                select(Shard.path).where(
                    Shard.id == shard_id, Shard.node == node, Shard.evicted_at.is_(None)
                )
            )
    if not path:
        raise NotFound(f"this node ({node}) holds no copy of shard {shard_id}", code="no_peer_copy")
    return Path(path)
