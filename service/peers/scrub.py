"""Re-reading this node's peer copies (part of the scrubber's round).

Each committed copy not verified for ``[scrub] min_age_hours`` is re-hashed
file by file against the catalog, within the round's byte budget. A copy
that disagrees (or lost a file) is marked ``corrupt``, removed, and a new
push of the shard is queued on its node: the copy is made again, here or on
another peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select, update

from ..config import ScrubSettings
from ..db import reading, transaction
from ..jobs import kinds
from ..models import Checkpoint, File, PeerCopy, PeerCopyState, Shard, priority_of, utcnow
from ..observability import metrics
from ..resources import Resources
from . import layout

log = logging.getLogger("tierckpt.peers")


def _check(base: Path, files: list[tuple[str, int, str | None]], chunk: int) -> str | None:
    """None if every file is intact, else what is wrong."""
    for relative, size, sha256 in files:
        path = layout.confined(base, relative)
        digest = hashlib.sha256()
        read = 0
        try:
            with open(path, "rb") as handle:
                while block := handle.read(chunk):
                    digest.update(block)
                    read += len(block)
        except FileNotFoundError:
            return f"{relative} is missing"
        if read != size:
            return f"{relative} holds {read} bytes, the catalog records {size}"
        if sha256 is not None and digest.hexdigest() != sha256:
            return f"{relative}: SHA-256 {digest.hexdigest()} differs from the catalog's {sha256}"
    return None


async def verify_peer_copies(resources: Resources, settings: ScrubSettings) -> int:
    """One round over this node's stalest copies; the number found corrupt."""
    node = resources.settings.server.node
    budget = settings.bytes_per_hour * settings.interval_seconds / 3600
    stale_before = utcnow() - timedelta(hours=settings.min_age_hours)
    async with reading(resources.sessionmaker)() as session:
        copies = list(
            await session.scalars(
                select(PeerCopy)
                .where(
                    PeerCopy.node == node,
                    PeerCopy.state == PeerCopyState.COMMITTED,
                    PeerCopy.verified_at <= stale_before,
                )
                .order_by(PeerCopy.verified_at)
                .limit(100)
            )
        )
        listings: dict[int, list[tuple[str, int, str | None]]] = {}
        for copy in copies:
            listings[copy.id] = [
                (path, size, sha256)
                for path, size, sha256 in await session.execute(
                    select(File.path, File.size, File.sha256).where(File.shard_id == copy.shard_id)
                )
            ]
    corrupt = 0
    spent = 0
    for copy in copies:
        files = listings[copy.id]
        if spent and spent + sum(size for _p, size, _s in files) > budget:
            break
        spent += sum(size for _p, size, _s in files)
        problem = await asyncio.to_thread(
            _check, Path(copy.path), files, resources.settings.peers.chunk_bytes
        )
        if problem is None:
            metrics.observe_peer_verified("scrub")
            async with transaction(resources.sessionmaker) as session:
                await session.execute(
                    update(PeerCopy)
                    .where(PeerCopy.id == copy.id, PeerCopy.state == PeerCopyState.COMMITTED)
                    .values(verified_at=utcnow())
                )
            continue
        corrupt += 1
        metrics.observe_peer_corrupt("scrub")
        log.error("peer copy of shard %s at %s is corrupt: %s", copy.shard_id, copy.path, problem)
        await asyncio.to_thread(shutil.rmtree, copy.path, True)
        async with transaction(resources.sessionmaker) as session:
            await session.execute(
                update(PeerCopy)
                .where(PeerCopy.id == copy.id)
                .values(state=PeerCopyState.CORRUPT, error=problem[:2000])
            )
            shard_node = await session.scalar(select(Shard.node).where(Shard.id == copy.shard_id))
            checkpoint = await session.get(Checkpoint, copy.checkpoint_id)
            if shard_node is not None and checkpoint is not None:
                await kinds.enqueue_peer_push(
                    session,
                    copy.checkpoint_id,
                    shard_id=copy.shard_id,
                    node=shard_node,
                    priority=priority_of(checkpoint.priority),
                )
    if corrupt:
        resources.wake()
    return corrupt
