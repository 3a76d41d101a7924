"""Alembic environment: async engine, models' metadata, SQLite batch mode."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tierckpt.service.db import create_engine
from tierckpt.service.models import Base

config = context.config
target_metadata = Base.metadata
# Any constant shared by every tierckpt agent: the PostgreSQL advisory lock
# that serializes their migrations ("tierckpt" in ASCII).
MIGRATION_LOCK = 0x74696572636B7074


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        # SQLite runs DDL in transactions too; as one transaction (opened with
        # BEGIN IMMEDIATE, see db._sqlite_transactions) a migration is all or
        # nothing, and agents starting together on one catalog file take turns.
        transactional_ddl=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Agents sharing a catalog start together (a deploy, a cluster
            # restart): without this, each reads "not migrated yet" and all
            # but one fail on tables the first one created. The lock is held
            # to the end of the migration's transaction; the next agent then
            # reads the new version and has nothing to do.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()


async def _run_async() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_configure)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    asyncio.run(_run_async())


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
