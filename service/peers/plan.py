"""The peer sources of a restore plan: copies on live peer agents.

Each file is read from an agent holding a committed copy of its shard, the
answering agent's own first (the client asks its node's agent: its copy is
the nearest), then the others in a fixed order. A checkpoint's ranks may be
on different peers, so a source takes each rank from its ``i``-th holder
(the last one when a rank has fewer): source 0 the nearest holders, source
1 the next ones, and so on; a file failing its hash in one is read from the
next. The URLs are the peers' own (absolute); the client sends its token
with them (``tier = "peer"``). No peer source unless every rank asked for
has a live holder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from urllib.parse import quote

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints.schemas import PlanFile, PlanSource
from ..config import Settings
from ..models import PeerCopy, PeerCopyState, Shard
from . import agents
from .state import spread_key


async def peer_sources(
    session: AsyncSession,
    settings: Settings,
    checkpoint_id: int,
    files: Sequence[PlanFile],
) -> list[PlanSource]:
    """``files``: the plan's files (their ``url`` is replaced)."""
    ranks = {f.rank for f in files}
    if not ranks:
        return []
    live = await agents.live_agents(session, settings.peers.lease_seconds)
    holders: dict[int, list[str]] = defaultdict(list)
    shard_of: dict[int, int] = {}
    rows = await session.execute(
        select(Shard.id, Shard.rank, PeerCopy.node)
        .join(PeerCopy, PeerCopy.shard_id == Shard.id)
        .where(
            Shard.checkpoint_id == checkpoint_id,
            PeerCopy.state == PeerCopyState.COMMITTED,
        )
    )
    here = settings.server.node
    for shard_id, rank, node in rows:
        if node in live:
            holders[rank].append(node)
            shard_of[rank] = shard_id
    if any(not holders[rank] for rank in ranks):
        return []
    for rank, nodes in holders.items():
        nodes.sort(key=lambda n: (n != here, spread_key(shard_of[rank], n)))
    sources = []
    seen = set()
    for i in range(max(len(holders[rank]) for rank in ranks)):
        chosen = {rank: holders[rank][min(i, len(holders[rank]) - 1)] for rank in ranks}
        key = tuple(sorted(chosen.items()))
        if key in seen:
            continue
        seen.add(key)
        planned = [
            f.model_copy(
                update={
                    "url": f"{live[chosen[f.rank]].url}/v1/peers/shards/{shard_of[f.rank]}"
                    f"/files/{quote(f.path)}"
                }
            )
            for f in files
        ]
        name = "peer:" + "+".join(sorted(set(chosen.values())))
        sources.append(PlanSource(region=name, files=planned, tier="peer"))
    return sources
