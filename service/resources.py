"""Everything an agent holds while it runs, built once in the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from .config import Settings
from .storage.factory import Stores

if TYPE_CHECKING:
    from .checkpoints.batching import RegistrationBatcher
    from .integrity.scrub import Scrubber
    from .jobs.worker import Worker
    from .retention.sweeper import RetentionSweeper


@dataclass
class Resources:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    stores: Stores
    # For GET requests: no write lock taken on SQLite (db.create_read_sessionmaker).
    read_sessionmaker: async_sessionmaker[AsyncSession] | None = field(default=None)
    # SQLite only: plain (sync) read-only sessions, for hot reads that run
    # whole in one worker thread (db.create_sync_readers).
    sync_readers: orm.sessionmaker[orm.Session] | None = field(default=None)
    worker: Worker | None = field(default=None)
    scrubber: Scrubber | None = field(default=None)
    sweeper: RetentionSweeper | None = field(default=None)
    # The registration writer (group commit), made on first use.
    registrations: RegistrationBatcher | None = field(default=None)

    def wake_worker(self) -> None:
        if self.worker is not None:
            self.worker.wake()
