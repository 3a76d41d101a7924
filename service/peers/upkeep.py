"""The agent's peer pass, every ``[peers] interval_seconds``.

1. **Heartbeat**: this agent's row in the agents catalog (announced at the
   first pass, refreshed at every other): peers push only to live agents,
   and restore plans list only live agents' copies.
2. **Takeover**: a shard whose node's agent is dead (heartbeat older than
   ``[peers] lease_seconds``), not yet uploaded, of which this node holds a
   committed copy, becomes this node's shard: the shard's node and path
   point at the copy (one conditional update: of several peers holding a
   copy, one wins) and its upload jobs are bound to this node, so the
   worker here uploads it from the copy (its files have the registered
   sizes and mtimes, and the upload checks them against the catalog's
   hashes as usual). The checkpoint still becomes durable.
3. **Retention**: of this node's copies, the newest ``[peers] keep_last``
   checkpoints per run are kept; older ones are evicted, except copies of a
   checkpoint not yet durable (then perhaps its only copy besides a lost
   node's T0) and a copy that became the shard's own T0 copy by takeover
   (T0 retention evicts that one).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select, update

from ..db import reading, transaction
from ..models import (
    AgentRow,
    CheckpointState,
    Job,
    JobKind,
    JobState,
    PeerCopy,
    PeerCopyState,
    Shard,
    ShardState,
    utcnow,
)
from ..resources import Resources
from . import agents
from .repository import held_here

log = logging.getLogger("tierckpt.peers")

# A checkpoint in one of these states needs no peer copy any more.
SAFE_ELSEWHERE = (CheckpointState.DURABLE, CheckpointState.REPLICATED)
GONE = (CheckpointState.FAILED, CheckpointState.DELETED)


class PeerUpkeep:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self.settings = resources.settings
        self._announced = False

    async def run_once(self) -> None:
        async with transaction(self.r.sessionmaker) as session:
            if self._announced:
                await agents.heartbeat(session, self.settings)
            else:
                await agents.announce(session, self.settings)
                self._announced = True
        if await self.take_over():
            self.r.wake()
        await self.evict()

    async def take_over(self) -> int:
        node = self.settings.server.node
        dead_before = utcnow() - timedelta(seconds=self.settings.peers.lease_seconds)
        async with reading(self.r.sessionmaker)() as session:
            rows = (
                await session.execute(
                    select(PeerCopy.shard_id, PeerCopy.path, Shard.node)
                    .join(Shard, Shard.id == PeerCopy.shard_id)
                    .join(AgentRow, AgentRow.node == Shard.node)
                    .where(
                        PeerCopy.node == node,
                        PeerCopy.state == PeerCopyState.COMMITTED,
                        Shard.node != node,
                        Shard.state.in_((ShardState.REGISTERED, ShardState.UPLOADING)),
                        AgentRow.heartbeat_at < dead_before,
                    )
                )
            ).all()
        taken = 0
        for shard_id, path, dead in rows:
            async with transaction(self.r.sessionmaker) as session:
                moved = await session.execute(
                    update(Shard)
                    .where(Shard.id == shard_id, Shard.node == dead)
                    .values(node=node, path=path, is_directory=True)
                )
                if not moved.rowcount:  # type: ignore[attr-defined]
                    continue  # another peer took it first
                await session.execute(
                    update(Job)
                    .where(
                        Job.shard_id == shard_id,
                        Job.kind == JobKind.UPLOAD,
                        Job.state.in_((JobState.QUEUED, JobState.RUNNING)),
                    )
                    .values(node=node)
                )
            taken += 1
            log.warning(
                "agent of %s is dead: this node uploads shard %s from its peer copy %s",
                dead,
                shard_id,
                path,
            )
        return taken

    async def evict(self) -> int:
        node = self.settings.server.node
        async with reading(self.r.sessionmaker)() as session:
            rows = await held_here(session, node)
        held = [
            Held(
                copy.id, copy.path, run, step, state, shard_node == node and shard_path == copy.path
            )
            for copy, shard_node, shard_path, _sstate, _cid, step, state, run in rows
        ]
        evicted = 0
        for copy in to_evict(held, self.settings.peers.keep_last):
            await asyncio.to_thread(shutil.rmtree, copy.path, True)
            async with transaction(self.r.sessionmaker) as session:
                await session.execute(
                    update(PeerCopy)
                    .where(PeerCopy.id == copy.id)
                    .values(state=PeerCopyState.DELETED)
                )
            evicted += 1
        return evicted


@dataclass(frozen=True)
class Held:
    """A committed copy on this node, as retention sees it."""

    id: int
    path: str
    run: str
    step: int
    checkpoint_state: str
    # Taken over: the shard's own T0 copy now, T0 retention's to evict.
    is_shard_t0: bool = False


def to_evict(held: list[Held], keep_last: int) -> list[Held]:
    """The copies beyond the newest ``keep_last`` checkpoints per run, but
    never one of a checkpoint not yet durable (it may be the only copy left
    of a lost node's checkpoint); every copy of a failed or deleted one."""
    steps: dict[str, set[int]] = defaultdict(set)
    for copy in held:
        if copy.checkpoint_state not in GONE:
            steps[copy.run].add(copy.step)
    newest = {run: set(sorted(found)[-keep_last:]) for run, found in steps.items()}
    chosen = []
    for copy in held:
        if copy.is_shard_t0:
            continue
        if copy.checkpoint_state in GONE:
            chosen.append(copy)
        elif copy.step not in newest[copy.run] and copy.checkpoint_state in SAFE_ELSEWHERE:
            chosen.append(copy)
    return chosen
