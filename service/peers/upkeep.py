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
3. **Top-up**: this node's shards not yet durable with fewer than ``[peers]
   copies`` copies on live agents (a peer died, a push gave up while no
   peer was up) get a new push when a live agent could take one.
4. **Retention**: of this node's copies, the newest ``[peers] keep_last``
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
from ..jobs import kinds
from ..models import (
    AgentRow,
    Checkpoint,
    CheckpointState,
    Job,
    JobKind,
    JobState,
    PeerCopy,
    PeerCopyState,
    Shard,
    ShardState,
    priority_of,
    utcnow,
)
from ..resources import Resources
from . import agents
from .repository import held_here
from .state import GONE

log = logging.getLogger("tierckpt.peers")

# Shards looked at per pass by the top-up, newest first.
TOP_UP_LIMIT = 500

# A checkpoint in one of these states needs no peer copy any more.
SAFE_ELSEWHERE = (CheckpointState.DURABLE, CheckpointState.REPLICATED)


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
        woken = await self.take_over()
        woken += await self.top_up()
        if woken:
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

    async def top_up(self) -> int:
        """Queue a push for this node's shards not yet durable that have fewer
        than ``[peers] copies`` committed copies on live agents (a peer died,
        a push gave up while no peer was up), when a live agent of another
        failure domain could take one. Not for durable ones: their copies
        serve restores only, and the peers' retention evicts them."""
        wanted = self.settings.peers.copies
        if wanted <= 0:
            return 0
        node = self.settings.server.node
        domain = self.settings.server.domain
        async with reading(self.r.sessionmaker)() as session:
            live = await agents.live_agents(session, self.settings.peers.lease_seconds)
            others = {
                a.node for a in live.values() if a.node != node and a.failure_domain != domain
            }
            if not others:
                return 0
            shards = (
                await session.execute(
                    select(Shard.id, Shard.checkpoint_id, Checkpoint.priority)
                    .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
                    .where(
                        Shard.node == node,
                        Shard.evicted_at.is_(None),
                        Checkpoint.state.in_(
                            (CheckpointState.REGISTERED, CheckpointState.UPLOADING)
                        ),
                    )
                    .order_by(Shard.id.desc())
                    .limit(TOP_UP_LIMIT)
                )
            ).all()
            ids = [shard_id for shard_id, _c, _p in shards]
            if not ids:
                return 0
            held: dict[int, set[str]] = defaultdict(set)
            for shard_id, holder in await session.execute(
                select(PeerCopy.shard_id, PeerCopy.node).where(
                    PeerCopy.shard_id.in_(ids), PeerCopy.state == PeerCopyState.COMMITTED
                )
            ):
                if holder in live and holder != node:
                    held[shard_id].add(holder)
            pushing = set(
                await session.scalars(
                    select(Job.shard_id).where(
                        Job.shard_id.in_(ids),
                        Job.kind == JobKind.PEER_PUSH,
                        Job.state.in_((JobState.QUEUED, JobState.RUNNING)),
                    )
                )
            )
        due = [
            (shard_id, checkpoint_id, priority)
            for shard_id, checkpoint_id, priority in shards
            if shard_id not in pushing and len(held[shard_id]) < wanted and others - held[shard_id]
        ]
        if not due:
            return 0
        async with transaction(self.r.sessionmaker) as session:
            for shard_id, checkpoint_id, priority in due:
                await kinds.enqueue_peer_push(
                    session,
                    checkpoint_id,
                    shard_id=shard_id,
                    node=node,
                    priority=priority_of(priority),
                )
        log.info("peers: queued %d push(es) of shards short of copies", len(due))
        return len(due)

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
