"""Catalog queries behind the interval advice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Checkpoint


async def recent_timings(session: AsyncSession, run_id: int, window: int) -> Sequence[Any]:
    """(step, created_at, durable_at, write_seconds, priority) of the run's
    ``window`` newest checkpoints, newest first."""
    rows = await session.execute(
        select(
            Checkpoint.step,
            Checkpoint.created_at,
            Checkpoint.durable_at,
            Checkpoint.write_seconds,
            Checkpoint.priority,
        )
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc())
        .limit(window)
    )
    return rows.all()
