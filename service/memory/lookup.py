"""Where a checkpoint's copies are, and the newest one a node holds.

The rule (docs/API.md, "The memory tier"): `latest` is unchanged, the newest
*durable* checkpoint. `latest?node=N&scope=node` is the newest checkpoint
node N holds, in memory or on T0, durable or not: a restart on the same node
may resume from it without waiting for the upload. What it risks: a
checkpoint that is not durable is lost with the node (memory with a reboot,
T0 with the disk); a restart elsewhere resumes from the older durable one,
and the ranks of a sharded run on other nodes may hold other steps, so only
a single-rank run should resume from it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select

from ..checkpoints.inbox import RegistrationInbox
from ..checkpoints.latest_answer import latest_json
from ..checkpoints.schemas import CheckpointOut, CopyOut, PeerOut
from ..checkpoints.service import CheckpointService
from ..errors import BadInput, NotFound
from ..models import Checkpoint, CheckpointState, ReplicaState, Run, Shard
from ..peers.view import peer_view
from ..prefetch import copies
from ..resources import Resources
from .service import MemoryTier

HELD_STATES = (
    CheckpointState.REGISTERED,
    CheckpointState.UPLOADING,
    CheckpointState.DURABLE,
    CheckpointState.REPLICATED,
)
DURABLE_STATES = (CheckpointState.DURABLE, CheckpointState.REPLICATED)
# Seconds a detail waits for its checkpoint's inbox record to reach the
# catalog (milliseconds, unless the catalog is slow or down).
INBOX_WAIT = 2.0


async def detail(
    service: CheckpointService,
    memory: MemoryTier | None,
    run: str,
    step: int,
    inbox: RegistrationInbox | None = None,
) -> CheckpointOut:
    """The detail view, with ``copies``: memory (this agent's arena), T0 (the
    shards' files not evicted), peers (committed shard copies on other
    nodes, and ``peers``: each peer node's state) and the regions holding a
    committed copy. A
    checkpoint only staged in memory is answered from the arena, one only
    recorded in the inbox (its catalog write late: the catalog slow or down)
    from its record."""
    if inbox is not None and not await inbox.settled(run, step, timeout=INBOX_WAIT):
        recorded = inbox.answer_of(run, step)
        if recorded is not None:
            return recorded
    try:
        detail = await service.detail(run, step)
    except NotFound:
        staged = memory.staged_of(run, step) if memory is not None else []
        if not staged:
            raise
        return CheckpointOut.model_validate(memory.staged_document(run, staged))  # type: ignore[union-attr]
    # The copies come from the rows the detail has read (the shards: T0 and
    # the peers' ranks); this answer is what callers poll while they wait.
    out, shards = detail.out, detail.shards
    copies: list[dict[str, Any]] = []
    if memory is not None:
        copies += memory.memory_copies(memory.held(run, step))
    copies += _t0_copies(shards)
    peers = peer_view(detail.checkpoint, shards, detail.peer_copies, service.settings.peers.copies)
    copies += peers.copies
    copies += await _prefetched_copies(service, detail.checkpoint.id, out)
    copies += [
        {
            "tier": "region",
            "node": None,
            "rank": None,
            "path": None,
            "region": r.region,
            "uri": r.uri,
        }
        for r in out.replicas
        if r.state == ReplicaState.COMMITTED
    ]
    return out.model_copy(
        update={
            "copies": [CopyOut.model_validate(c) for c in copies],
            "peers": [PeerOut.model_validate(p) for p in peers.peers],
            "peer_safe": peers.peer_safe,
        }
    )


def _t0_copies(shards: Sequence[Shard | Any]) -> list[dict[str, Any]]:
    """The shards not evicted from T0, by rank (``shards`` are in rank order)."""
    return [
        {"tier": "t0", "node": s.node, "rank": s.rank, "path": s.path, "region": None, "uri": None}
        for s in shards
        if s.evicted_at is None
    ]


async def _prefetched_copies(
    service: CheckpointService, checkpoint_id: int, out: CheckpointOut
) -> list[dict[str, Any]]:
    """This agent's node's intact prefetched copy of the checkpoint, rank by
    rank (prefetch/copies.py); other nodes' are theirs to vouch for."""
    if not out.files:
        return []
    settings = service.settings
    directory = copies.step_dir(settings, out.run, out.step)
    # Most checkpoints were never prefetched here: one stat on the loop says
    # so, without the thread hop that reading the copy's marker takes.
    if not directory.is_dir():
        return []
    ranks = await asyncio.to_thread(
        copies.intact_ranks,
        directory,
        checkpoint_id,
        [(f.rank, f.path, f.size, f.sha256) for f in out.files],
    )
    node = settings.server.node
    return [
        {"tier": "t0", "node": node, "rank": r, "path": p, "region": None, "uri": None}
        for r, p in ranks.items()
    ]


async def node_latest(
    resources: Resources,
    service: CheckpointService,
    memory: MemoryTier | None,
    run: str,
    node: str | None,
    region: str | None,
) -> dict[str, Any]:
    """The newest checkpoint ``node`` holds (memory or T0), durable or not,
    with ``durable``, ``durable_step`` (what plain `latest` answers) and
    ``memory`` (this agent's segments holding it, one per rank)."""
    if not node:
        raise BadInput("scope=node needs node=<the node asking>", code="invalid_request")
    try:
        durable: dict[str, Any] | None = json.loads(await latest_json(resources, run, region, node))
    except NotFound:
        durable = None
    durable_step = durable["step"] if durable is not None else None
    mine = memory is not None and node == resources.settings.server.node
    held = memory.held(run) if mine and memory is not None else []
    memory_steps = {s.step for s in held if s.state != "failed"}
    t0_step = await _newest_on_t0(service, run, node)
    candidates = [s for s in (durable_step, t0_step, *memory_steps) if s is not None]
    if not candidates:
        raise NotFound(
            f"run {run!r} has no checkpoint on node {node!r} nor a valid one",
            code="no_valid_checkpoint",
        )
    step = max(candidates)
    if durable is not None and step == durable_step:
        document = durable
    else:
        try:
            document = (await service.get(run, step)).model_dump(mode="json")
            shard = next((s for s in document["shards"] if s["node"] == node), None)
            document["local"] = (
                {"node": node, "path": shard["path"], "ranks": {"0": shard["path"]}}
                if shard is not None and step == t0_step and document["world_size"] == 1
                else None
            )
        except NotFound:  # staged in memory only
            assert memory is not None
            document = memory.staged_document(run, memory.staged_of(run, step))
            document["local"] = None
        document["locations"] = [
            {"region": r["region"], "uri": r["uri"]}
            for r in document["replicas"]
            if r["state"] == ReplicaState.COMMITTED
        ]
    document["durable"] = document["state"] in DURABLE_STATES
    document["durable_step"] = durable_step
    document["memory"] = (
        [
            {"node": node, "rank": s.rank, "path": str(s.data)}
            for s in sorted(held, key=lambda s: s.rank)
            if s.step == step and s.state != "failed"
        ]
        if memory is not None
        else []
    )
    return document


async def _newest_on_t0(service: CheckpointService, run: str, node: str) -> int | None:
    step = await service.session.scalar(
        select(Checkpoint.step)
        .join(Run, Run.id == Checkpoint.run_id)
        .join(Shard, Shard.checkpoint_id == Checkpoint.id)
        .where(
            Run.name == run,
            Shard.node == node,
            Shard.evicted_at.is_(None),
            Checkpoint.state.in_([s.value for s in HELD_STATES]),
            Checkpoint.quarantined_at.is_(None),
        )
        .order_by(Checkpoint.step.desc())
        .limit(1)
    )
    return step
