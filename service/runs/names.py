"""A run's name by its id, read from the catalog once per process.

Every job of a checkpoint needs its run's name (it is part of every object
key) and read it with a statement of its own: four per checkpoint of the
worker's seventy-odd. A run is never renamed or removed (created by its
first registration, kept as long as the catalog; a rebuild only inserts),
so a name once read stays right for as long as the catalog's connection
pool lives, which is what the names are kept by. Bounded: the least
recently used go first.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Run

MAX_NAMES = 4096
_BY_POOL: weakref.WeakKeyDictionary[Any, OrderedDict[int, str]] = weakref.WeakKeyDictionary()


def _names_of(session: AsyncSession) -> OrderedDict[int, str] | None:
    bind = session.bind
    pool = getattr(getattr(bind, "sync_engine", None), "pool", None)
    if pool is None:
        return None
    names = _BY_POOL.get(pool)
    if names is None:
        names = _BY_POOL[pool] = OrderedDict()
    return names


async def name_of_run(session: AsyncSession, run_id: int) -> str:
    """The name of run ``run_id``; raises NoResultFound when there is none."""
    names = _names_of(session)
    if names is not None and run_id in names:
        names.move_to_end(run_id)
        return names[run_id]
    name = (await session.scalars(select(Run.name).where(Run.id == run_id))).one()
    if names is not None:
        names[run_id] = name
        if len(names) > MAX_NAMES:
            names.popitem(last=False)
    return name
