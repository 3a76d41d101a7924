"""Catalog queries of the prefetch endpoints."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Checkpoint, Job, JobKind, Run


async def prefetch_jobs(
    session: AsyncSession,
    run_id: int,
    *,
    step: int | None = None,
    ids: Sequence[int] | None = None,
    limit: int = 100,
) -> list[tuple[Job, int]]:
    """The run's prefetch jobs with their checkpoint's step, newest first
    (of ``step`` only, or only ``ids``)."""
    query = (
        select(Job, Checkpoint.step)
        .join(Checkpoint, Checkpoint.id == Job.checkpoint_id)
        .where(Checkpoint.run_id == run_id, Job.kind == JobKind.PREFETCH)
        .order_by(Job.id.desc())
        .limit(limit)
    )
    if step is not None:
        query = query.where(Checkpoint.step == step)
    if ids is not None:
        query = query.where(Job.id.in_(ids))
    return [(job, job_step) for job, job_step in (await session.execute(query)).all()]


async def run_named(session: AsyncSession, name: str) -> Run | None:
    return await session.scalar(select(Run).where(Run.name == name))
