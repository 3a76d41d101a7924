"""Fixtures shared by the integration tests (the session-wide ones are in tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from tierckpt.service.db import create_engine, create_sessionmaker, transaction
from tierckpt.service.migrate import upgrade
from tierckpt.service.models import Checkpoint, Run

Seeded = tuple[async_sessionmaker[AsyncSession], list[int]]


@pytest.fixture
async def seeded_catalog(catalog_url: str) -> AsyncIterator[Callable[[int], Awaitable[Seeded]]]:
    """A factory: the migrated catalog of ``catalog_url`` with one run "r" and
    ``count`` checkpoints (steps 0 … count-1); returns (sessionmaker, their ids)."""
    engines: list[AsyncEngine] = []

    async def seed(count: int) -> Seeded:
        await asyncio.to_thread(upgrade, catalog_url)
        engine = create_engine(catalog_url)
        engines.append(engine)
        sessionmaker = create_sessionmaker(engine)
        async with transaction(sessionmaker) as session:
            run = Run(name="r")
            session.add(run)
            await session.flush()
            checkpoints = [Checkpoint(run_id=run.id, step=s) for s in range(count)]
            session.add_all(checkpoints)
        return sessionmaker, [c.id for c in checkpoints]

    yield seed
    for engine in engines:
        await engine.dispose()
