"""The Alembic migrations create exactly what the models describe, on both catalogs."""

from __future__ import annotations

import asyncio
import sys

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


async def test_agents_starting_together_migrate_in_turn(catalog_url: str) -> None:
    """Agents sharing a catalog start at once after a deploy: each process
    migrates at `serve` start. Without a lock, all but one read "not
    migrated yet" and then fail on the tables the first one created."""
    script = f"from tierckpt.service.migrate import upgrade; upgrade({catalog_url!r})"
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stderr=asyncio.subprocess.PIPE
        )
        for _ in range(4)
    ]
    outcomes = [(await p.communicate())[1].decode()[-2000:] for p in processes]
    failed = [err for p, err in zip(processes, outcomes, strict=True) if p.returncode != 0]
    assert not failed, failed[0]
    await asyncio.to_thread(check, catalog_url)  # at head, matching the models
