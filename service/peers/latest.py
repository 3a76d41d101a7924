"""``latest?peer_safe=true``: the newest peer-safe checkpoint, when it is
newer than the newest durable one.

The rule (docs/API.md, "The peer tier"): a checkpoint not yet durable whose
every shard has ``[peers] copies`` committed copies on other nodes
(state.py) survives the loss of any one failure domain, so a restart may
resume from it while the uploads lag. What it risks: a loss of every node
holding it (a whole-cluster outage, or more failure domains than it has
copies) before the upload finishes; the restart then has to fall back to
the newest durable checkpoint, which is older. Only asked for explicitly.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import VALID_STATES, Checkpoint, CheckpointState, Run, Shard
from . import agents
from .repository import copies_of
from .state import peer_safe

# Not-yet-durable checkpoints looked at, newest first: peer-safety is a
# matter of the last few saves.
CANDIDATES = 16


async def newest_peer_safe(
    session: AsyncSession, run: str, needed: int, lease_seconds: float
) -> Checkpoint | None:
    if needed <= 0:
        return None
    run_id = await session.scalar(select(Run.id).where(Run.name == run))
    if run_id is None:
        return None
    durable_step = await session.scalar(
        select(func.max(Checkpoint.step)).where(
            Checkpoint.run_id == run_id,
            Checkpoint.state.in_(VALID_STATES),
            Checkpoint.quarantined_at.is_(None),
        )
    )
    query = (
        select(Checkpoint)
        .where(
            Checkpoint.run_id == run_id,
            Checkpoint.state.in_((CheckpointState.REGISTERED, CheckpointState.UPLOADING)),
            Checkpoint.quarantined_at.is_(None),
        )
        .order_by(Checkpoint.step.desc())
        .limit(CANDIDATES)
    )
    if durable_step is not None:
        query = query.where(Checkpoint.step > durable_step)
    candidates = list(await session.scalars(query))
    # A restart reads from live agents only: a dead peer's copy does not count.
    live = await agents.live_agents(session, lease_seconds)
    for checkpoint in candidates:
        shards = {
            shard_id: node
            for shard_id, node in await session.execute(
                select(Shard.id, Shard.node).where(Shard.checkpoint_id == checkpoint.id)
            )
        }
        copies = await copies_of(session, [checkpoint.id])
        if peer_safe(checkpoint.world_size, shards, copies, needed, live):
            return checkpoint
    return None
