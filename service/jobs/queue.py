"""The durable job queue kept in the catalog.

Jobs are claimed with one statement, ``UPDATE … WHERE id = (SELECT … FOR
UPDATE SKIP LOCKED LIMIT 1) RETURNING``: on PostgreSQL many agents claim
concurrently without blocking each other; on SQLite the same statement is
atomic because SQLite has a single writer. A claim hands out a lease token;
every later transition checks it, so a worker whose lease expired and was
reclaimed elsewhere can no longer complete, retry or fail that job.

The moves of queued jobs from one kind to another (a replicate job
superseding uploads from T0, an upload that cannot finish hurrying the
replicate job that replaces it) are here too; what each kind carries and how
it is enqueued is in ``kinds``.
"""

from __future__ import annotations

import functools
import random
import secrets
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Table,
    Update,
    and_,
    bindparam,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession

from ..db import bound_values, dialect_name, value_params
from ..models import Job, JobKind, JobState, Shard, utcnow


class LeaseLost(Exception):
    """The job's lease expired and another worker took it over."""


def dedupe_key(kind: str, checkpoint_id: int, shard_id: int | None, region: str | None) -> str:
    return f"{kind}:{checkpoint_id}:{shard_id or '-'}:{region or '-'}"


def job_values(
    kind: str,
    checkpoint_id: int,
    *,
    shard_id: int | None = None,
    region: str | None = None,
    node: str | None = None,
    priority: int = 0,
    payload: dict[str, Any] | None = None,
    max_attempts: int = 10,
    delay_seconds: float = 0.0,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The row of a new queued job (for ``enqueue`` and ``enqueue_many``)."""
    now = now or utcnow()
    return {
        "kind": kind,
        "state": JobState.QUEUED.value,
        "priority": priority,
        "checkpoint_id": checkpoint_id,
        "shard_id": shard_id,
        "region": region,
        "node": node,
        "payload": payload or {},
        "dedupe_key": dedupe_key(kind, checkpoint_id, shard_id, region),
        "attempts": 0,
        "max_attempts": max_attempts,
        "run_after": now + timedelta(seconds=delay_seconds),
        "created_at": now,
        "updated_at": now,
    }


JOBS = cast(Table, Job.__table__)


def _insert_ignoring_active(dialect_name_: str) -> Any:
    dialect = postgresql if dialect_name_ == "postgresql" else sqlite
    return dialect.insert(JOBS).on_conflict_do_nothing(index_elements=["dedupe_key"])


# The statements of the worker's every transaction, built once and bound per
# call: building an ORM statement (and its cache key, from the values it
# embeds) took longer than SQLite ran it, inside transactions that hold the
# catalog's write lock, which a registration may be waiting for.
_ENQUEUE = {
    name: _insert_ignoring_active(name).returning(JOBS.c.id) for name in ("postgresql", "sqlite")
}


async def enqueue(
    session: AsyncSession,
    kind: str,
    checkpoint_id: int,
    *,
    shard_id: int | None = None,
    region: str | None = None,
    node: str | None = None,
    priority: int = 0,
    payload: dict[str, Any] | None = None,
    max_attempts: int = 10,
    delay_seconds: float = 0.0,
) -> int | None:
    """Add a job unless the same one is already active; the new job's id, or
    None when it was already there.

    Call it inside the transaction that creates the row the job is about, so
    the two commit (or vanish) together.
    """
    values = job_values(
        kind,
        checkpoint_id,
        shard_id=shard_id,
        region=region,
        node=node,
        priority=priority,
        payload=payload,
        max_attempts=max_attempts,
        delay_seconds=delay_seconds,
    )
    return await enqueue_row(session, values)


async def enqueue_row(session: AsyncSession, values: dict[str, Any]) -> int | None:
    """``enqueue`` of a row from ``job_values``."""
    result = await session.execute(_ENQUEUE[dialect_name(session)], values)
    job_id: int | None = result.scalar_one_or_none()
    return job_id


async def enqueue_rows(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """``enqueue`` of several rows from ``job_values`` in one statement; how
    many were added (those already active are skipped)."""
    if not rows:
        return 0
    statement = _insert_ignoring_active(dialect_name(session)).values(rows).returning(JOBS.c.id)
    return len((await session.execute(statement)).all())


def enqueue_many(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Add several jobs (rows from ``job_values``) in one statement, skipping
    any that is already active; same transaction rule as ``enqueue``. On a
    synchronous connection (the registration writer's, see batching.py)."""
    if rows:
        conn.execute(_insert_ignoring_active(conn.dialect.name), rows)


def node_work(node: str) -> ColumnElement[bool]:
    """The jobs a draining agent must finish before its node goes: those
    bound to the node (they read its SSD: nobody else can run them), and the
    commits of checkpoints with a shard on it (a checkpoint is durable only
    once its manifest is written). Not its prefetches: they only serve a
    restart on the node that is going away."""
    return or_(
        # A prefetch is not: it only serves a restart on this very node.
        and_(Job.node == node, Job.kind != JobKind.PREFETCH),
        and_(
            Job.node.is_(None),
            Job.kind == JobKind.COMMIT,
            # Correlated: the few queued commits each look up their own
            # shards (indexed by checkpoint), not every shard of the node.
            select(Shard.id)
            .where(Shard.checkpoint_id == Job.checkpoint_id, Shard.node == node)
            .exists(),
        ),
    )


async def node_work_left(session: AsyncSession, node: str) -> int:
    """Queued or running jobs of ``node_work(node)``, whoever holds them."""
    count = await session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.state.in_((JobState.QUEUED, JobState.RUNNING)), node_work(node))
    )
    return int(count or 0)


async def claim(
    session: AsyncSession,
    *,
    owner: str,
    node: str,
    lease_seconds: float,
    node_work_only: bool = False,
) -> Job | None:
    """Take the best runnable job for this node, or None; with
    ``node_work_only`` (a drain) only one of ``node_work(node)``."""
    now = utcnow()
    mine = node_work(node) if node_work_only else or_(Job.node.is_(None), Job.node == node)
    runnable = (
        select(Job.id)
        .where(
            or_(
                and_(Job.state == JobState.QUEUED, Job.run_after <= now),
                # A running job whose lease ran out belongs to a dead worker.
                and_(Job.state == JobState.RUNNING, Job.lease_expires_at < now),
            ),
            mine,
        )
        .order_by(Job.priority.desc(), Job.id)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    statement = (
        update(Job)
        .where(Job.id == runnable)
        .values(**_taken(owner, lease_seconds, now))
        .returning(Job)
        .execution_options(synchronize_session=False)
    )
    return (await session.scalars(statement)).one_or_none()


def _taken(owner: str, lease_seconds: float, now: datetime) -> dict[str, Any]:
    """The columns of a job that an agent starts: running, leased to it, one
    more attempt."""
    return {
        "state": JobState.RUNNING,
        "lease_token": secrets.token_hex(16),
        "lease_owner": owner,
        "lease_expires_at": now + timedelta(seconds=lease_seconds),
        "attempts": Job.attempts + 1,
        "updated_at": now,
    }


async def claim_queued(
    session: AsyncSession, job_id: int, *, owner: str, lease_seconds: float
) -> Job | None:
    """Take one queued job by its id (a job that just enqueued it runs it next
    in the same task, see ``worker.run_next``), or None when it is not
    runnable now (running elsewhere, over, or waiting for its backoff)."""
    now = utcnow()
    taken = _taken(owner, lease_seconds, now)
    params = value_params({column: taken[column] for column in _TAKEN_BOUND})
    return (
        await session.scalars(_CLAIM_QUEUED, {"b_id": job_id, "b_now": now, **params})
    ).one_or_none()


# claim_queued's statement, built once: _taken's columns bound, but the
# attempts the database counts.
_TAKEN_BOUND = ("state", "lease_token", "lease_owner", "lease_expires_at", "updated_at")
_CLAIM_QUEUED = (
    update(Job)
    .where(
        Job.id == bindparam("b_id"),
        Job.state == JobState.QUEUED.value,
        Job.run_after <= bindparam("b_now"),
    )
    .values({**bound_values(_TAKEN_BOUND), "attempts": Job.attempts + 1})
    .returning(Job)
    .execution_options(synchronize_session=False)
)


async def extend_leases(session: AsyncSession, tokens: list[str], lease_seconds: float) -> int:
    if not tokens:
        return 0
    result = await session.execute(
        update(Job)
        .where(Job.lease_token.in_(tokens), Job.state == JobState.RUNNING)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=32)
def _transition_statement(columns: tuple[str, ...]) -> Update:
    """The UPDATE of a leased job setting ``columns`` (bound as ``v_<column>``)."""
    return (
        update(JOBS)
        .where(
            JOBS.c.id == bindparam("b_id"),
            JOBS.c.lease_token == bindparam("b_token"),
            JOBS.c.state == JobState.RUNNING.value,
        )
        .values(bound_values(columns))
    )


async def _transition(session: AsyncSession, job: Job, **values: Any) -> None:
    values["updated_at"] = utcnow()
    bound = {k: v for k, v in values.items() if not isinstance(v, ColumnElement)}
    # A value computed by the database (release's attempts - 1) stays in the SQL.
    computed = {k: v for k, v in values.items() if k not in bound}
    statement = _transition_statement(tuple(sorted(bound)))
    if computed:
        statement = statement.values(computed)
    result = await session.execute(
        statement, {"b_id": job.id, "b_token": job.lease_token, **value_params(bound)}
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        raise LeaseLost(f"job {job.id} ({job.kind}) was taken over by another worker")


async def complete(session: AsyncSession, job: Job) -> None:
    await _transition(
        session,
        job,
        state=JobState.SUCCEEDED,
        dedupe_key=None,
        lease_token=None,
        lease_expires_at=None,
        finished_at=utcnow(),
    )


def _done_unrun(*conditions: ColumnElement[bool]) -> Update:
    """The UPDATE marking queued jobs done without running them, another job
    having done their work (built once per use, bound per call)."""
    return (
        update(JOBS)
        .where(JOBS.c.state == JobState.QUEUED.value, *conditions)
        .values(
            state=JobState.SUCCEEDED.value,
            dedupe_key=None,
            finished_at=bindparam("b_now"),
            updated_at=bindparam("b_now"),
        )
    )


_COMPLETE_QUEUED = _done_unrun(JOBS.c.id.in_(bindparam("b_ids", expanding=True)))


async def complete_queued(session: AsyncSession, job_ids: list[int]) -> int:
    """Mark queued jobs done without running them, another job having done
    their work (retention at durable: retention/at_durable.py); those no
    longer queued (claimed meanwhile) are left to run. How many were marked."""
    if not job_ids:
        return 0
    result = await session.execute(_COMPLETE_QUEUED, {"b_ids": job_ids, "b_now": utcnow()})
    return result.rowcount or 0  # type: ignore[attr-defined]


async def fail(session: AsyncSession, job: Job, error: str) -> None:
    await _transition(
        session,
        job,
        state=JobState.FAILED,
        dedupe_key=None,
        lease_token=None,
        lease_expires_at=None,
        last_error=error[:4000],
        finished_at=utcnow(),
    )


def backoff_seconds(attempts: int, base: float, ceiling: float) -> float:
    """Exponential backoff with full jitter: no thundering herd after an outage."""
    return random.uniform(base / 2, min(ceiling, base * 2 ** max(attempts - 1, 0)))


async def retry_later(session: AsyncSession, job: Job, error: str, delay_seconds: float) -> None:
    await _transition(
        session,
        job,
        state=JobState.QUEUED,
        lease_token=None,
        lease_owner=None,
        lease_expires_at=None,
        last_error=error[:4000],
        run_after=utcnow() + timedelta(seconds=delay_seconds),
    )


async def release(session: AsyncSession, job: Job) -> None:
    """Give a job back untouched (graceful shutdown): the attempt does not count."""
    await _transition(
        session,
        job,
        state=JobState.QUEUED,
        lease_token=None,
        lease_owner=None,
        lease_expires_at=None,
        attempts=Job.attempts - 1,
        run_after=utcnow(),
    )


async def release_node_leases(session: AsyncSession, node: str) -> int:
    """At agent start: jobs still leased to this node belong to its previous,
    dead incarnation (one agent per node), so they are runnable right away
    instead of after their lease times out."""
    result = await session.execute(
        update(Job)
        .where(
            Job.state == JobState.RUNNING, Job.lease_owner.startswith(f"{node}:", autoescape=True)
        )
        .values(
            state=JobState.QUEUED,
            lease_token=None,
            lease_owner=None,
            lease_expires_at=None,
            run_after=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    return result.rowcount or 0  # type: ignore[attr-defined]


async def supersede(session: AsyncSession, job_id: int, reason: str) -> bool:
    """Fail a job that has not started yet, because other work replaces it;
    False if it is already running or over (then it is left alone)."""
    result = await session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.QUEUED)
        .values(
            state=JobState.FAILED,
            dedupe_key=None,
            last_error=reason[:4000],
            finished_at=utcnow(),
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def expire_unclaimed(session: AsyncSession, kind: str, older_than: datetime) -> int:
    """Fail the jobs of ``kind`` queued before ``older_than`` that no worker
    ever claimed (their node's agent never came); how many."""
    result = await session.execute(
        update(Job)
        .where(
            Job.kind == kind,
            Job.state == JobState.QUEUED,
            Job.attempts == 0,
            Job.created_at < older_than,
        )
        .values(
            state=JobState.FAILED,
            dedupe_key=None,
            last_error=(
                "no agent of this node claimed it in time: is the node name its agent's "
                "[server] node, and is that agent running?"
            ),
            finished_at=utcnow(),
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


# -- moves between kinds ------------------------------------------------------


_UPLOADS_INTO_REGIONS = select(Job).where(
    Job.checkpoint_id == bindparam("b_id"),
    Job.kind.in_((JobKind.UPLOAD.value, JobKind.COMMIT.value)),
    Job.state.in_((JobState.QUEUED.value, JobState.RUNNING.value)),
)


async def _uploads_into_regions(session: AsyncSession, checkpoint_id: int) -> list[Job]:
    """Active upload/commit jobs of a checkpoint (primary, fan-out or T0 repair)."""
    return list(await session.scalars(_UPLOADS_INTO_REGIONS, {"b_id": checkpoint_id}))


async def regions_being_filled(session: AsyncSession, checkpoint_id: int) -> set[str]:
    """Regions an upload or commit from T0 is writing the checkpoint into."""
    return {
        job.region
        for job in await _uploads_into_regions(session, checkpoint_id)
        if job.region is not None
    }


async def supersede_uploads(session: AsyncSession, checkpoint_id: int, region: str) -> bool:
    """A replicate job is about to fill ``region`` from a committed region:
    uploads from T0 into it that have not started are superseded. False, and
    nothing superseded, when one has started or its commit is queued: the
    replicate job must wait for it rather than race it."""
    active = [
        job for job in await _uploads_into_regions(session, checkpoint_id) if job.region == region
    ]
    if any(job.kind != JobKind.UPLOAD or job.state != JobState.QUEUED for job in active):
        return False
    for job in active:
        await supersede(session, job.id, "superseded: copied from a committed region instead")
    return True


# replication_done's statement (it runs in every replica's commit).
_REPLICATION_DONE = _done_unrun(
    JOBS.c.checkpoint_id == bindparam("b_id"),
    JOBS.c.region == bindparam("b_region"),
    JOBS.c.kind == JobKind.REPLICATE.value,
)


async def replication_done(session: AsyncSession, checkpoint_id: int, region: str) -> None:
    """The region's copy of the checkpoint is committed: a replicate job still
    queued into it (the safety net an upload from T0 filling the region
    leaves, ``kinds.enqueue_replication``) has nothing left to do. Marked done
    now, in the commit's transaction, rather than claimed and run for nothing
    a grace period later. One already running finishes on its own."""
    await session.execute(
        _REPLICATION_DONE, {"b_id": checkpoint_id, "b_region": region, "b_now": utcnow()}
    )


async def hurry_replication(session: AsyncSession, checkpoint_id: int, region: str) -> None:
    """Run the queued replicate job into ``region`` now: the upload from T0 it
    was giving a grace period to will not finish."""
    await session.execute(
        update(Job)
        .where(
            Job.checkpoint_id == checkpoint_id,
            Job.region == region,
            Job.kind == JobKind.REPLICATE,
            Job.state == JobState.QUEUED,
        )
        .values(run_after=utcnow())
    )
