"""The Alembic migrations create exactly what the models describe, on both catalogs."""

from __future__ import annotations

import asyncio

from sqlalchemy import inspect

from tierckpt.service.db import create_engine
from tierckpt.service.migrate import check, upgrade


async def test_migrations_match_models(catalog_url: str) -> None:
    await asyncio.to_thread(upgrade, catalog_url)
    await asyncio.to_thread(upgrade, catalog_url)  # idempotent at head
    await asyncio.to_thread(check, catalog_url)  # raises if models and migrations disagree
    engine = create_engine(catalog_url)
    try:
        async with engine.connect() as connection:
            tables = await connection.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()
    assert {
        "runs",
        "checkpoints",
        "shards",
        "files",
        "replicas",
        "jobs",
        "alembic_version",
    } <= tables
