"""Applying retention: which checkpoints go, T0 eviction, incomplete expiry.

Deletion itself is a job (``retention/jobs.py``) so it survives a crash and
retries through region outages; this module only decides and enqueues.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import repository as repo
from ..config import RetentionPolicySettings
from ..db import reading, transaction
from ..errors import NotFound
from ..jobs import kinds, queue
from ..models import Checkpoint, CheckpointState, File, Run, Shard, utcnow
from ..prefetch import copies as prefetch_copies
from ..resources import Resources
from .policies import Candidate, Plan, build_policy, plan_retention
from .schemas import RetentionApplied, RetentionOut

log = logging.getLogger("tierckpt.retention")

# States whose objects retention may remove (a valid or once-valid copy exists).
RETAINABLE = (CheckpointState.DURABLE, CheckpointState.REPLICATED, CheckpointState.CORRUPT)
# Delete jobs queued per write transaction (see queue_deletions).
DELETIONS_PER_TRANSACTION = 16
# Checkpoint ids per lookup of already queued deletions: one IN list each,
# well under SQLite's limit of bound parameters.
IDS_PER_LOOKUP = 128

T = TypeVar("T")


def effective_policy(run: Run, resources: Resources) -> RetentionPolicySettings:
    if run.retention is not None:
        return RetentionPolicySettings.model_validate(run.retention)
    default = resources.settings.retention
    return RetentionPolicySettings.model_validate(default.model_dump(exclude={"interval_seconds"}))


async def protected_steps(session: AsyncSession, run: Run, min_regions: int) -> set[int]:
    """Never deleted: the latest valid checkpoint, pinned ones, and every
    ancestor (in this run) of a pinned one."""
    protected: set[int] = set()
    latest = await repo.latest_valid(session, run.id, min_regions)
    if latest is not None:
        protected.add(latest.step)
    pinned = await session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run.id, Checkpoint.pinned.is_(True))
    )
    for checkpoint in pinned:
        protected.add(checkpoint.step)
        parent_run, parent_step = checkpoint.parent_run, checkpoint.parent_step
        seen = 0
        while parent_run == run.name and parent_step is not None and seen < 100_000:
            protected.add(parent_step)
            parent = await repo.find_checkpoint(session, run.id, parent_step)
            if parent is None:
                break
            parent_run, parent_step = parent.parent_run, parent.parent_step
            seen += 1
    return protected


async def plan_for_run(session: AsyncSession, run: Run, resources: Resources) -> Plan:
    return (await _plan_and_ids(session, run, resources))[0]


async def _plan_and_ids(
    session: AsyncSession, run: Run, resources: Resources
) -> tuple[Plan, dict[int, int]]:
    """The run's plan, and the id of each step it considered. Columns, not
    ORM objects: a run registering faster than its deletions finish has
    thousands of candidates, planned at every checkpoint that turns durable."""
    rows = (
        await session.execute(
            select(Checkpoint.id, Checkpoint.step, Checkpoint.created_at, Checkpoint.metrics).where(
                Checkpoint.run_id == run.id, Checkpoint.state.in_(RETAINABLE)
            )
        )
    ).all()
    history = [Candidate(step, created, dict(metrics or {})) for _, step, created, metrics in rows]
    policy = build_policy(effective_policy(run, resources).model_dump())
    protected = await protected_steps(session, run, resources.settings.durability.min_regions)
    ids = {step: checkpoint_id for checkpoint_id, step, _, _ in rows}
    return plan_retention(history, policy, protected, utcnow()), ids


async def apply_run(session: AsyncSession, run: Run, resources: Resources) -> list[int]:
    plan, ids = await _plan_and_ids(session, run, resources)
    queued = []
    for step in sorted(plan.delete):
        if step in ids and await kinds.enqueue_delete(session, ids[step], plan.reason):
            queued.append(step)
    return queued


async def expire_incomplete(session: AsyncSession, resources: Resources) -> int:
    """Fail checkpoints whose missing ranks never arrived in time."""
    hours = resources.settings.durability.incomplete_timeout_hours
    cutoff = utcnow() - timedelta(hours=hours)
    shard_count = (
        select(func.count())
        .select_from(Shard)
        .where(Shard.checkpoint_id == Checkpoint.id)
        .correlate(Checkpoint)
        .scalar_subquery()
    )
    stale = await session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.state.in_((CheckpointState.REGISTERED, CheckpointState.UPLOADING)),
            Checkpoint.created_at < cutoff,
            shard_count < Checkpoint.world_size,
        )
        .with_for_update()
    )
    expired = 0
    for checkpoint in stale:
        count = await session.scalar(
            select(func.count()).select_from(Shard).where(Shard.checkpoint_id == checkpoint.id)
        )
        checkpoint.state = CheckpointState.FAILED
        checkpoint.error = (
            f"incomplete: only {count} of {checkpoint.world_size} ranks registered within "
            f"{hours:g} h"
        )
        expired += 1
    return expired


def _evict_files(
    directory: Path, files: list[str], roots: list[Path], whole_directory: bool
) -> int:
    """Delete a shard's registered files (never anything else) and the
    directories they leave empty, never leaving the shard's directory; that
    directory itself goes only when a whole directory was registered (a single
    file's directory belongs to the trainer)."""
    real_roots = [Path(os.path.realpath(r)) for r in roots]
    base = Path(os.path.realpath(directory))
    if not any(base.is_relative_to(r) and base != r for r in real_roots):
        raise ValueError(f"{directory} is not strictly under a local root; refusing to evict")
    removed = 0
    emptied: set[Path] = set()
    for relative in files:
        path = base / relative
        if not Path(os.path.realpath(path.parent)).is_relative_to(base):
            continue  # a parent turned into a link out of the shard: leave it
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        parent = path.parent
        while parent != base and parent.is_relative_to(base):
            emptied.add(parent)
            parent = parent.parent
    if whole_directory:
        emptied.add(base)
    for folder in sorted(emptied, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()  # only succeeds when empty
        except OSError:
            pass
    return removed


# One eviction at a time per catalog engine (so per process): the retain
# jobs of a run's checkpoints turning durable together and the periodic sweep
# each read the shards not yet evicted, and run side by side they removed and
# marked the same ones, a write transaction each, twice.
_EVICTING: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


async def evict_local_copies(resources: Resources, run_id: int | None = None) -> int:
    """T0: on this node, remove local copies that are durable elsewhere (or
    deleted) beyond ``[local].keep_last`` newest per run (every run, or
    ``run_id``'s). Prefetched copies (prefetch/copies.py) count among them;
    the newest one of a run stays even at ``keep_last = 0``: someone asked for it."""
    lock = _EVICTING.setdefault(resources.engine, asyncio.Lock())
    async with lock:
        return await _evict_local_copies(resources, run_id)


async def _evict_local_copies(resources: Resources, run_id: int | None) -> int:
    settings = resources.settings
    keep = settings.local.keep_last
    node = settings.server.node
    query = (
        select(Shard, Run.name, Checkpoint.step, Checkpoint.state)
        .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Shard.node == node, Shard.evicted_at.is_(None))
        .order_by(Checkpoint.run_id, Checkpoint.step.desc())
    )
    if run_id is not None:
        query = query.where(Checkpoint.run_id == run_id)
    prefetched = await asyncio.to_thread(prefetch_copies.held, settings)
    async with reading(resources.sessionmaker)() as session:
        rows = (await session.execute(query)).all()
        if run_id is not None:
            name = await session.scalar(select(Run.name).where(Run.id == run_id))
            prefetched = {name: prefetched[name]} if name in prefetched else {}
        # keep_last counts checkpoints (steps), not shards: the ranks of one
        # checkpoint saved on this node stay or go together.
        steps: dict[str, set[int]] = {run: set(held) for run, held in prefetched.items()}
        for _shard, run, step, _state in rows:
            steps.setdefault(run, set()).add(step)
        kept = {run: set(sorted(held, reverse=True)[:keep]) for run, held in steps.items()}
        victims: list[tuple[Shard, list[str]]] = []
        for shard, run, step, state in rows:
            if step in kept[run]:
                continue
            if state not in (
                CheckpointState.DURABLE,
                CheckpointState.REPLICATED,
                CheckpointState.DELETED,
            ):
                continue  # not safe anywhere else yet (or failed: keep for a person)
            names = list(await session.scalars(select(File.path).where(File.shard_id == shard.id)))
            victims.append((shard, names))
    evicted = 0
    for shard, names in victims:
        try:
            await asyncio.to_thread(
                _evict_files, Path(shard.path), names, settings.local.roots, shard.is_directory
            )
        except (OSError, ValueError) as exc:
            log.warning("T0 eviction of %s failed: %s", shard.path, exc)
            continue
        async with transaction(resources.sessionmaker) as session:
            await session.execute(
                update(Shard)
                .where(Shard.id == shard.id, Shard.evicted_at.is_(None))
                .values(evicted_at=utcnow())
            )
        evicted += 1
    for run, held in prefetched.items():
        # A prefetched copy is never the only one (it was fetched from a region).
        for step in sorted(held)[:-1]:
            if step in kept[run]:
                continue
            try:
                evicted += await asyncio.to_thread(prefetch_copies.remove, settings, run, step)
            except (OSError, ValueError) as exc:
                log.warning("T0 eviction of the prefetched %s:%d failed: %s", run, step, exc)
    return evicted


async def apply_all(resources: Resources) -> dict[str, int]:
    """One retention pass over every run (the sweeper's tick)."""
    async with transaction(resources.sessionmaker) as session:
        expired = await expire_incomplete(session, resources)
        unclaimed = await kinds.expire_prefetches(session, utcnow())
    deleted = await queue_deletions(resources)
    evicted = await evict_local_copies(resources)
    return {
        "expired": expired,
        "delete_queued": deleted,
        "evicted": evicted,
        "prefetch_expired": unclaimed,
    }


async def queue_deletions(resources: Resources, run_id: int | None = None) -> int:
    """Queue the deletions retention asks for, in every run or in ``run_id``'s;
    how many were queued (a deletion queued already is not counted)."""
    # Planning reads every run's history: it runs on a read snapshot, with
    # no write lock held (SQLite), and leaves out the checkpoints whose
    # deletion is queued already: a run that registers faster than its
    # deletions finish would otherwise have hundreds re-inserted (and
    # skipped) at every pass. The rest are queued a few per short
    # transaction, one statement each: every write transaction holds the
    # one SQLite write lock that a trainer's registration waits for. A plan
    # gone stale by then (a pin, a newer checkpoint failed) is treated as one
    # gone stale after its deletions were queued: the delete job checks its
    # refusals again under the checkpoint's lock (retention/jobs.py).
    rows: list[dict[str, Any]] = []
    async with reading(resources.sessionmaker)() as session:
        runs = select(Run) if run_id is None else select(Run).where(Run.id == run_id)
        for run in list(await session.scalars(runs)):
            plan, ids = await _plan_and_ids(session, run, resources)
            victims = [ids[step] for step in sorted(plan.delete) if step in ids]
            for some in _chunks(victims, IDS_PER_LOOKUP):
                queued = set(await session.scalars(kinds.deleting(some)))
                rows += [kinds.delete_row(i, plan.reason) for i in some if i not in queued]
    deleted = 0
    for some_rows in _chunks(rows, DELETIONS_PER_TRANSACTION):
        async with transaction(resources.sessionmaker) as session:
            deleted += await queue.enqueue_rows(session, some_rows)
    return deleted


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- the per-run retention endpoints ------------------------------------------


async def _existing_run(session: AsyncSession, name: str) -> Run:
    run = await repo.find_run(session, name)
    if run is None:
        raise NotFound(f"run {name!r} has no checkpoints", code="run_not_found")
    return run


async def run_retention(session: AsyncSession, resources: Resources, name: str) -> RetentionOut:
    """The run's effective policy and what it would delete now."""
    run = await _existing_run(session, name)
    plan = await plan_for_run(session, run, resources)
    return RetentionOut(
        run=name,
        policy=effective_policy(run, resources),
        overridden=run.retention is not None,
        would_delete=sorted(plan.delete),
    )


async def override_retention(
    session: AsyncSession, resources: Resources, name: str, policy: RetentionPolicySettings
) -> RetentionOut:
    """Give the run its own policy (a run not registered yet is created)."""
    run = await repo.get_or_create_run(session, name)
    run.retention = policy.model_dump(exclude_none=True)
    await session.commit()
    return await run_retention(session, resources, name)


async def apply_retention_now(
    session: AsyncSession, resources: Resources, name: str
) -> RetentionApplied:
    """Apply the run's policy now instead of at the next periodic pass."""
    run = await _existing_run(session, name)
    queued = await apply_run(session, run, resources)
    await session.commit()
    resources.wake()
    return RetentionApplied(run=name, delete_queued=queued)
