"""Catalog queries behind the dashboard pages (read-only)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints.replicas import LIVE
from ..models import (
    Checkpoint,
    CheckpointState,
    Job,
    JobState,
    Replica,
    ReplicaState,
    Run,
)

ACTIVE_JOBS = (JobState.QUEUED, JobState.RUNNING)


async def newest_registration(session: AsyncSession, run_ids: list[int]) -> dict[int, datetime]:
    """When each run last registered a checkpoint."""
    return {
        run_id: when
        for run_id, when in await session.execute(
            select(Checkpoint.run_id, func.max(Checkpoint.created_at))
            .where(Checkpoint.run_id.in_(run_ids))
            .group_by(Checkpoint.run_id)
        )
    }


async def pending_replicas(session: AsyncSession, run_ids: list[int]) -> Sequence[Any]:
    """(run_id, count) of pending replicas of live checkpoints."""
    rows = await session.execute(
        select(Checkpoint.run_id, func.count())
        .join(Replica, Replica.checkpoint_id == Checkpoint.id)
        .where(
            Checkpoint.run_id.in_(run_ids),
            Checkpoint.state.in_(LIVE),
            Replica.state == ReplicaState.PENDING,
        )
        .group_by(Checkpoint.run_id)
    )
    return rows.all()


async def failed_checkpoints(session: AsyncSession, run_ids: list[int]) -> Sequence[Any]:
    """(run_id, count) of failed or corrupt checkpoints."""
    rows = await session.execute(
        select(Checkpoint.run_id, func.count())
        .where(
            Checkpoint.run_id.in_(run_ids),
            Checkpoint.state.in_((CheckpointState.FAILED, CheckpointState.CORRUPT)),
        )
        .group_by(Checkpoint.run_id)
    )
    return rows.all()


async def retrying_jobs(session: AsyncSession, run_ids: list[int]) -> Sequence[Any]:
    """(run_id, count) of active jobs that failed at least once."""
    rows = await session.execute(
        select(Checkpoint.run_id, func.count())
        .join(Job, Job.checkpoint_id == Checkpoint.id)
        .where(
            Checkpoint.run_id.in_(run_ids),
            Job.state.in_(ACTIVE_JOBS),
            Job.last_error.is_not(None),
        )
        .group_by(Checkpoint.run_id)
    )
    return rows.all()


async def active_job_counts(session: AsyncSession) -> Sequence[Any]:
    """(kind, state, count, count with an error) of active jobs."""
    rows = await session.execute(
        select(
            Job.kind,
            Job.state,
            func.count(),
            func.count(Job.last_error),
        )
        .where(Job.state.in_(ACTIVE_JOBS))
        .group_by(Job.kind, Job.state)
    )
    return rows.all()


async def failing_jobs(session: AsyncSession, run_id: int, limit: int) -> list[Job]:
    """The run's jobs with an error, still retrying or failed, newest first."""
    return list(
        await session.scalars(
            select(Job)
            .join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
            .where(
                Checkpoint.run_id == run_id,
                Job.last_error.is_not(None),
                or_(Job.state.in_(ACTIVE_JOBS), Job.state == JobState.FAILED),
            )
            .order_by(Job.updated_at.desc())
            .limit(limit)
        )
    )


async def step_of(session: AsyncSession, checkpoint_id: int) -> int | None:
    return await session.scalar(select(Checkpoint.step).where(Checkpoint.id == checkpoint_id))


async def forks(
    session: AsyncSession, run: Run, steps: list[int], limit: int
) -> Sequence[tuple[str, Checkpoint]]:
    """Checkpoints of other runs whose parent is one of ``steps`` of ``run``."""
    rows = await session.execute(
        select(Run.name, Checkpoint)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(
            Checkpoint.parent_run == run.name,
            Checkpoint.parent_step.in_(steps),
            Checkpoint.run_id != run.id,
        )
        .order_by(Checkpoint.created_at)
        .limit(limit)
    )
    return [(name, child) for name, child in rows]
