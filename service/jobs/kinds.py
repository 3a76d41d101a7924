"""The registry of job kinds: for each, its payload, its retry policy and the
one function that enqueues it.

Features enqueue through these functions only, so what a job carries and how
often it is tried is decided here, not by whoever enqueues it. The moves of a
job between kinds that only touch queued rows (supersede, hurry) are in
``queue``; the one that also enqueues (fall back to replication) is here.

Payloads are stored as JSON in the job row and read back by the handler; the
stored form is the one agents of earlier versions write and read, so a job
queued before an upgrade still runs, and two agents of different versions on
one catalog understand each other's jobs.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..config import WorkerSettings
from ..models import (
    ENDED_STATES,
    PRIORITY,
    Checkpoint,
    Job,
    JobKind,
    Shard,
    priority_of,
)
from . import queue

# Effectively forever: with backoff capped at [worker].backoff_max, a region
# can be down for weeks and its replicas still arrive once it is back.
REPLICATE_MAX_ATTEMPTS = 1_000_000

# How long a replicate job waits before checking on an upload from T0 that is
# filling its region (``[upload] fan_out``); it then waits for a running one,
# and replaces one that never started (its node may be gone).
FAN_OUT_GRACE_SECONDS = 30.0


# With backoff capped at [worker] backoff_max, a push waits a good hour for
# a peer to come up before it gives up.
PEER_PUSH_MAX_ATTEMPTS = 30


# -- payloads -----------------------------------------------------------------


class UploadMode(enum.StrEnum):
    PRIMARY = "primary"  # the shard's first copy, into the primary region
    # From the T0 copy into a secondary region, alongside the primary's
    # upload (``[upload] fan_out``): the regions fill in parallel.
    FAN_OUT = "fan_out"
    REPAIR = "repair"  # from the T0 copy into a region whose copy went bad


@dataclass(frozen=True)
class UploadPayload:
    mode: UploadMode = UploadMode.PRIMARY

    def to_json(self) -> dict[str, Any]:
        # Stored as a flag named after the mode ({"repair": true}); a primary
        # upload carries none.
        return {} if self.mode == UploadMode.PRIMARY else {self.mode.value: True}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> UploadPayload:
        data = data or {}
        if data.get("repair"):
            return cls(UploadMode.REPAIR)
        if data.get("fan_out"):
            return cls(UploadMode.FAN_OUT)
        return cls(UploadMode.PRIMARY)


@dataclass(frozen=True)
class DeletePayload:
    reason: str = "deleted"
    # Delete even the run's latest valid checkpoint (a person asked for it).
    force: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"reason": self.reason, "force": self.force}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> DeletePayload:
        data = data or {}
        return cls(reason=str(data.get("reason") or "deleted"), force=bool(data.get("force")))


@dataclass(frozen=True)
class NoPayload:
    """Kinds whose row (checkpoint, region) says everything."""

    def to_json(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> NoPayload:
        return cls()


# -- retry policies -----------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts a kind gets. Between two attempts every kind waits the
    worker's exponential backoff with full jitter (``queue.backoff_seconds``
    over ``[worker] backoff_base`` .. ``backoff_max``); an outage only delays."""

    # None: the agent's ``[worker] max_attempts`` (work that may really fail).
    max_attempts: int | None = None

    def attempts(self, worker: WorkerSettings | None = None) -> int:
        if self.max_attempts is not None:
            return self.max_attempts
        if worker is None:
            raise ValueError("this kind's attempts are [worker] max_attempts: pass the settings")
        return worker.max_attempts


Payload = UploadPayload | DeletePayload | NoPayload


@dataclass(frozen=True)
class Kind:
    name: JobKind
    payload: type[Payload]
    retry: RetryPolicy


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        # Bound to the shard's node (it reads that node's SSD).
        Kind(JobKind.UPLOAD, UploadPayload, RetryPolicy()),
        Kind(JobKind.COMMIT, NoPayload, RetryPolicy()),
        # Never gives up: an outage of the target region only delays it.
        Kind(JobKind.REPLICATE, NoPayload, RetryPolicy(REPLICATE_MAX_ATTEMPTS)),
        Kind(JobKind.VERIFY, NoPayload, RetryPolicy(1000)),
        # Region outages only delay a deletion.
        Kind(JobKind.DELETE, DeletePayload, RetryPolicy(1_000_000)),
        # Bound to a node (it evicts that node's T0 copies); only ever early:
        # the periodic sweep does the same work later if this one gives up.
        Kind(JobKind.RETAIN, NoPayload, RetryPolicy(10)),
        # Bound to the shard's node (it reads that node's T0); retried while no
        # peer is reachable, then given up: the regions remain the safe copy.
        Kind(JobKind.PEER_PUSH, NoPayload, RetryPolicy(PEER_PUSH_MAX_ATTEMPTS)),
        # Bound to a node (it writes that node's T0); a region outage or a
        # bad copy only delays it, within [worker] max_attempts.
        Kind(JobKind.PREFETCH, NoPayload, RetryPolicy()),
    )
}


def payload_of(kind: str, data: Mapping[str, Any] | None) -> Payload:
    """A stored payload read as its kind's type."""
    return KINDS[kind].payload.from_json(data)


# -- enqueue, one function per kind -------------------------------------------
# Each adds the job unless the same one (kind, checkpoint, shard, region) is
# active already (True, or the new job's id, if added); call it in the
# transaction that makes the job necessary, so both commit or vanish together.


def upload_row(
    checkpoint_id: int,
    *,
    shard_id: int,
    region: str,
    node: str | None,
    mode: UploadMode,
    worker: WorkerSettings,
    priority: int = 0,
    now: datetime | None = None,
) -> dict[str, Any]:
    """An upload job's row, for ``enqueue_upload`` or, many at once, for
    ``queue.enqueue_many`` (the registration writer inserts a whole batch's
    primary uploads in one statement)."""
    return queue.job_values(
        JobKind.UPLOAD,
        checkpoint_id,
        shard_id=shard_id,
        region=region,
        node=node,
        priority=priority,
        payload=UploadPayload(mode).to_json(),
        max_attempts=KINDS[JobKind.UPLOAD].retry.attempts(worker),
        now=now,
    )


async def enqueue_upload(
    session: AsyncSession,
    checkpoint_id: int,
    *,
    shard_id: int,
    region: str,
    node: str | None,
    mode: UploadMode,
    worker: WorkerSettings,
    priority: int = 0,
) -> int | None:
    row = upload_row(
        checkpoint_id,
        shard_id=shard_id,
        region=region,
        node=node,
        mode=mode,
        worker=worker,
        priority=priority,
    )
    return await queue.enqueue_row(session, row)


async def enqueue_commit(
    session: AsyncSession,
    checkpoint_id: int,
    *,
    region: str,
    worker: WorkerSettings,
    priority: int = 0,
) -> int | None:
    return await queue.enqueue(
        session,
        JobKind.COMMIT,
        checkpoint_id,
        region=region,
        priority=priority,
        max_attempts=KINDS[JobKind.COMMIT].retry.attempts(worker),
    )


async def enqueue_replicate(
    session: AsyncSession, checkpoint: Checkpoint, region: str, *, delay_seconds: float = 0.0
) -> bool:
    """Queue a copy of the checkpoint into ``region`` (a pending or corrupt replica)."""
    added = await queue.enqueue(
        session,
        JobKind.REPLICATE,
        checkpoint.id,
        region=region,
        priority=priority_of(checkpoint.priority),
        max_attempts=KINDS[JobKind.REPLICATE].retry.attempts(),
        delay_seconds=delay_seconds,
    )
    return added is not None


async def enqueue_replication(
    session: AsyncSession, checkpoint: Checkpoint, regions: Container[str]
) -> int:
    """Queue a copy into every region of ``regions`` (those this agent can
    write) whose replica is pending or corrupt; how many were added."""
    if checkpoint.state in ENDED_STATES:
        return 0
    filling = await queue.regions_being_filled(session, checkpoint.id)
    added = 0
    for region in await replicas.regions_needing_copy(session, checkpoint.id):
        if region not in regions:
            continue
        added += await enqueue_replicate(
            session,
            checkpoint,
            region,
            # An upload from T0 is filling that region already: the replicate
            # job is the safety net (node lost, upload failed), not a rival.
            delay_seconds=FAN_OUT_GRACE_SECONDS if region in filling else 0.0,
        )
    return added


async def enqueue_verify(
    session: AsyncSession, checkpoint_id: int, region: str, priority: int = 0
) -> bool:
    added = await queue.enqueue_row(session, verify_row(checkpoint_id, region, priority))
    return added is not None


def verify_row(checkpoint_id: int, region: str, priority: int = 0) -> dict[str, Any]:
    """The row of a verify job (``enqueue_verify``, ``queue.enqueue_rows``)."""
    return queue.job_values(
        JobKind.VERIFY,
        checkpoint_id,
        region=region,
        priority=priority,
        max_attempts=KINDS[JobKind.VERIFY].retry.attempts(),
    )


def delete_row(checkpoint_id: int, reason: str, *, force: bool = False) -> dict[str, Any]:
    """The row of a delete job (``enqueue_delete``, ``queue.enqueue_rows``)."""
    return queue.job_values(
        JobKind.DELETE,
        checkpoint_id,
        payload=DeletePayload(reason, force).to_json(),
        max_attempts=KINDS[JobKind.DELETE].retry.attempts(),
    )


async def enqueue_delete(
    session: AsyncSession, checkpoint_id: int, reason: str, *, force: bool = False
) -> bool:
    added = await queue.enqueue_row(session, delete_row(checkpoint_id, reason, force=force))
    return added is not None


def deleting(checkpoint_ids: list[int]) -> Any:
    """Those of ``checkpoint_ids`` whose delete job is active (queued or
    running: its dedupe key is set)."""
    keys = [queue.dedupe_key(JobKind.DELETE, i, None, None) for i in checkpoint_ids]
    return select(Job.checkpoint_id).where(Job.dedupe_key.in_(keys))


# The nodes holding a shard of a checkpoint, each with its first shard.
_NODES_OF = (
    select(Shard.node, func.min(Shard.id))
    .where(Shard.checkpoint_id == bindparam("b_id"))
    .group_by(Shard.node)
)


async def enqueue_retention(session: AsyncSession, checkpoint: Checkpoint) -> None:
    """Apply the run's retention now that ``checkpoint`` is durable, rather
    than at the next periodic sweep: one job per node holding a shard of it,
    since each node evicts its own T0 copies (the regions' deletions are
    queued by whichever runs first; the others find them queued)."""
    nodes = await session.execute(_NODES_OF, {"b_id": checkpoint.id})
    for node, shard_id in nodes:
        await queue.enqueue(
            session,
            JobKind.RETAIN,
            checkpoint.id,
            # One job per node: the dedupe key holds the shard, not the node.
            shard_id=shard_id,
            node=node,
            max_attempts=KINDS[JobKind.RETAIN].retry.attempts(),
        )


def peer_push_row(
    checkpoint_id: int,
    *,
    shard_id: int,
    node: str,
    priority: int = 0,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A peer push job's row (the registration writer inserts it with the
    shard's upload when ``[peers] copies`` is set)."""
    return queue.job_values(
        JobKind.PEER_PUSH,
        checkpoint_id,
        shard_id=shard_id,
        node=node,
        priority=priority,
        max_attempts=KINDS[JobKind.PEER_PUSH].retry.attempts(),
        now=now,
    )


async def enqueue_peer_push(
    session: AsyncSession, checkpoint_id: int, *, shard_id: int, node: str, priority: int = 0
) -> bool:
    """Push the shard to peers again (a copy went corrupt or was lost);
    False when one is queued already."""
    job_id = await queue.enqueue_row(
        session, peer_push_row(checkpoint_id, shard_id=shard_id, node=node, priority=priority)
    )
    return job_id is not None


async def enqueue_prefetch(
    session: AsyncSession, checkpoint_id: int, node: str, *, worker: WorkerSettings
) -> int | None:
    """Queue a prefetch of the checkpoint into ``node``'s T0, urgent (a
    restart waits for it); the id of the job, or of the one already active
    for that checkpoint and node (one at a time per node, not per region)."""
    row = queue.job_values(
        JobKind.PREFETCH,
        checkpoint_id,
        node=node,
        priority=PRIORITY["urgent"],
        max_attempts=KINDS[JobKind.PREFETCH].retry.attempts(worker),
    )
    row["dedupe_key"] = prefetch_dedupe_key(checkpoint_id, node)
    await queue.enqueue_row(session, row)
    return await session.scalar(select(Job.id).where(Job.dedupe_key == row["dedupe_key"]))


# A prefetch serves an imminent restart: one that no agent of its node has
# claimed after this long (a node name that is no agent's, an agent that is
# gone) is failed by the retention pass instead of waiting for ever.
PREFETCH_UNCLAIMED_SECONDS = 3600.0


async def expire_prefetches(session: AsyncSession, now: datetime) -> int:
    return await queue.expire_unclaimed(
        session, JobKind.PREFETCH, now - timedelta(seconds=PREFETCH_UNCLAIMED_SECONDS)
    )


def prefetch_dedupe_key(checkpoint_id: int, node: str) -> str:
    # The node is the job's target, so it belongs in the key (255 characters
    # at most: node names are 128 at most, see prefetch/schemas.py).
    return f"{JobKind.PREFETCH}:{checkpoint_id}:{node}"


# -- moves between kinds that enqueue -------------------------------------------


async def fall_back_to_replication(
    session: AsyncSession, checkpoint: Checkpoint, region: str, regions: Container[str]
) -> None:
    """An upload or commit from T0 into ``region`` cannot finish: the region is
    filled from a committed region instead, by a replicate job that never
    gives up, and at once (it may be waiting out its grace period for this
    very upload)."""
    await enqueue_replication(session, checkpoint, regions)
    await queue.hurry_replication(session, checkpoint.id, region)
