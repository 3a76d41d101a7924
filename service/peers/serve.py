"""Which directory of this node holds a committed copy of a shard."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from ..db import reading
from ..errors import NotFound
from ..models import PeerCopy, PeerCopyState
from ..resources import Resources


async def committed_copy_path(resources: Resources, shard_id: int) -> Path:
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
        raise NotFound(
            f"this node ({node}) holds no committed copy of shard {shard_id}",
            code="no_peer_copy",
        )
    return Path(path)
