"""The agent's infrastructure: settings, catalog engines and session makers,
one object store per region, and a way to wake the worker.

Built once at startup (``open_resources``) and closed last (``close_resources``).
Features receive it and use only the infrastructure they need; it knows no
feature, so anything may import it. The background components that use it
(worker, registration writer, periodic passes) are assembled in ``agent.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from .config import Settings
from .db import (
    create_engine,
    create_read_sessionmaker,
    create_sessionmaker,
    create_sync_readers,
    dispose_read_engine,
    dispose_sync_readers,
)
from .row_reads import RowReaders, create_row_readers
from .storage.base import StoreError
from .storage.factory import Stores, build_stores

log = logging.getLogger("tierckpt")


def _no_worker() -> None:
    """The wake-up of an agent that runs no worker: nobody to wake."""


def no_memory_tier(shard_path: Path, relative: str) -> int | None:
    """An agent without a memory tier holds no file anywhere but on T0."""
    return None


@dataclass
class Resources:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    stores: Stores
    # The hot path's reads of plain rows (`latest`, the register's check),
    # without a session (row_reads.py).
    rows: RowReaders
    # For GET requests: no write lock taken on SQLite (db.create_read_sessionmaker).
    read_sessionmaker: async_sessionmaker[AsyncSession] | None = field(default=None)
    # SQLite only: plain (sync) read-only sessions, for hot reads that run
    # whole in one worker thread (db.create_sync_readers).
    sync_readers: orm.sessionmaker[orm.Session] | None = field(default=None)
    # SQLite only: the same, for reads run on the event loop (db.read_snapshot).
    inline_readers: orm.sessionmaker[orm.Session] | None = field(default=None)
    # Work was just enqueued in this process: the worker looks now instead of
    # at its next poll. Set by the agent's assembly when it runs a worker.
    wake: Callable[[], None] = field(default=_no_worker)
    # Opens, for reading, the memory tier's copy of a registered T0 file
    # (shard path, relative path), or None: an upload reads a checkpoint
    # staged in memory from there while the agent still writes it to T0.
    # Set by the agent's assembly when it has a memory tier.
    open_in_memory: Callable[[Path, str], int | None] = field(default=no_memory_tier)


async def open_resources(settings: Settings, *, check_regions: bool = True) -> Resources:
    """``check_regions``: see that each region is ready (creating what it
    needs); the worker process skips it, the agent did it before starting it."""
    engine = create_engine(settings.catalog.url, bounded=True)
    stores = build_stores(settings)
    for store in stores.values() if check_regions else ():
        try:
            await store.ensure_ready()
        except StoreError as exc:
            # A region that is down must not stop the agent: its jobs retry.
            log.warning("region %s not ready: %s", store.region, exc)
    read_sessionmaker = create_read_sessionmaker(engine)
    sync_readers = create_sync_readers(engine)
    return Resources(
        settings=settings,
        engine=engine,
        sessionmaker=create_sessionmaker(engine),
        read_sessionmaker=read_sessionmaker,
        sync_readers=sync_readers,
        inline_readers=create_sync_readers(engine, inline=True),
        rows=create_row_readers(
            engine,
            read_sessionmaker.kw["bind"],
            sync_readers.kw["bind"] if sync_readers is not None else None,
        ),
        stores=stores,
    )


async def close_resources(resources: Resources) -> None:
    """After the agent's components have stopped: stores, then the catalog."""
    await resources.stores.aclose()
    dispose_sync_readers(resources.sync_readers)
    dispose_sync_readers(resources.inline_readers)
    resources.rows.dispose()
    if resources.read_sessionmaker is not None:
        await dispose_read_engine(resources.read_sessionmaker, resources.engine)
    await resources.engine.dispose()
