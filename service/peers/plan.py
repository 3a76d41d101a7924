"""The agents' sources of a restore plan: the shards' own T0 copies (not
evicted) and their committed peer copies, on live agents, served by those
agents (``GET /v1/peers/shards/{shard}/files/{path}``).

Each file is read from an agent holding a copy of its shard, the answering
agent's own first (the client asks its node's agent: its copy is the
nearest), then the others in a fixed order. A source is named after the
copies it reads, ``t0:<node>`` (the shard's own node) and ``peer:<node>``,
joined by ``+``. A checkpoint's ranks may be
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
    own = await session.execute(
        select(Shard.id, Shard.rank, Shard.node).where(
            Shard.checkpoint_id == checkpoint_id, Shard.evicted_at.is_(None)
        )
    )
    origin: dict[int, str] = {}
    for shard_id, rank, node in [*own, *rows]:
        origin.setdefault(rank, node)  # the shards come first: their own node
        if node in live and node not in holders[rank]:
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
        names = sorted(
            {f"t0:{n}" if origin.get(r) == n else f"peer:{n}" for r, n in chosen.items()}
        )
        sources.append(PlanSource(region="+".join(names), files=planned, tier="peer"))
    return sources
