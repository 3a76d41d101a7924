"""A read of several statements (a GET, a background pass) sees one snapshot.

Without it, on PostgreSQL (READ COMMITTED, or the read engine's autocommit),
each statement read its own: a checkpoint's detail could show a verify job
finished beside the replica as it was before that job wrote it, and
`tierckpt verify` returned without the outcome it waited for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tierckpt.service.db import create_read_sessionmaker, dispose_read_engine, reading, transaction
from tierckpt.service.models import Checkpoint, CheckpointState

from .conftest import Seeded


async def _state(session: AsyncSession, checkpoint_id: int) -> str:
    return str(await session.scalar(select(Checkpoint.state).where(Checkpoint.id == checkpoint_id)))


async def _second_read_sees_the_first_snapshot(
    readers: async_sessionmaker[AsyncSession],
    writers: async_sessionmaker[AsyncSession],
    checkpoint_id: int,
) -> None:
    async with readers() as session:
        before = await _state(session, checkpoint_id)
        async with transaction(writers) as writer:
            await writer.execute(
                update(Checkpoint)
                .where(Checkpoint.id == checkpoint_id)
                .values(state=CheckpointState.DURABLE)
            )
        assert await _state(session, checkpoint_id) == before
    async with readers() as session:
        assert await _state(session, checkpoint_id) == CheckpointState.DURABLE


async def test_reading_sessions_read_one_snapshot(
    seeded_catalog: Callable[[int], Awaitable[Seeded]],
) -> None:
    writers, (checkpoint_id,) = await seeded_catalog(1)
    await _second_read_sees_the_first_snapshot(reading(writers), writers, checkpoint_id)


async def test_get_request_sessions_read_one_snapshot(
    seeded_catalog: Callable[[int], Awaitable[Seeded]],
) -> None:
    """What a GET uses (deps.get_session): the read engine (autocommit on
    PostgreSQL), made a snapshot by ``reading``."""
    writers, (checkpoint_id,) = await seeded_catalog(1)
    engine = writers.kw["bind"]
    read_engine = create_read_sessionmaker(engine)
    try:
        await _second_read_sees_the_first_snapshot(reading(read_engine), writers, checkpoint_id)
    finally:
        await dispose_read_engine(read_engine, engine)


async def test_reading_refuses_writes_on_postgresql(
    catalog_url: str, seeded_catalog: Callable[[int], Awaitable[Seeded]]
) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("SQLite's snapshot readers are read-only by convention (no lock taken)")
    writers, (checkpoint_id,) = await seeded_catalog(1)
    with pytest.raises(Exception, match="read-only"):
        async with reading(writers)() as session:
            await session.execute(
                update(Checkpoint)
                .where(Checkpoint.id == checkpoint_id)
                .values(state=CheckpointState.DURABLE)
            )
