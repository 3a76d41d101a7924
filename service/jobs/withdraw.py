"""Taking back what a job wrote for a checkpoint deleted while it ran.

Deletion marks the checkpoint deleted, then sweeps its objects region by
region. An upload, commit or replication already under way can land objects
in a region after the sweep went by. The job takes them back, and only then
is it marked done: killed in between, it runs again, finds the checkpoint
deleted and takes them back then. What stays (the store is down) is never
valid to anyone: the catalog says deleted, and a catalog rebuild re-verifies
every object it finds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ..db import transaction
from ..models import Job
from ..storage.base import ObjectStore, StoreError
from . import queue

log = logging.getLogger(__name__)


async def withdraw(store: ObjectStore, keys: Iterable[str]) -> None:
    """Best effort: delete ``keys`` from the region."""
    for key in keys:
        try:
            await store.delete(key)
        except StoreError as exc:
            log.warning("could not withdraw %s from %s: %s", key, store.region, exc)


async def withdraw_then_complete(
    sessionmaker: async_sessionmaker[AsyncSession],
    store: ObjectStore,
    keys: Iterable[str],
    job: Job,
) -> None:
    """Take back ``keys``, then mark ``job`` done (in this order: see above)."""
    await withdraw(store, keys)
    async with transaction(sessionmaker) as session:
        await queue.complete(session, job)
