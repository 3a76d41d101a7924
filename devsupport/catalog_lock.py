"""Hold a catalog's write lock from outside the agent, as a long background
transaction would: its writes wait, its reads go on.

SQLite: ``BEGIN IMMEDIATE`` on a connection of this process (WAL readers are
not blocked). PostgreSQL: ``LOCK TABLE checkpoints IN EXCLUSIVE MODE`` in an
open transaction, on a connection of its own thread and loop, which blocks
every insert into and row lock of ``checkpoints`` but no plain ``SELECT``.
A sync context manager, usable from sync tests and (briefly blocking) from
async ones; also ``rows(url, sql)`` to look at the catalog meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from .postgres import asyncpg_dsn


def _sqlite_path(url: str) -> str:
    database = make_url(url).database
    assert database, url
    return database


@contextlib.contextmanager
def catalog_write_lock(url: str) -> Iterator[None]:
    if url.startswith("sqlite"):
        conn = sqlite3.connect(_sqlite_path(url), isolation_level=None, timeout=30)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    held, release = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    async def hold() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            async with conn.transaction():
                await conn.execute("LOCK TABLE checkpoints IN EXCLUSIVE MODE")
                held.set()
                await asyncio.to_thread(release.wait)
        finally:
            await conn.close()

    def run() -> None:
        try:
            asyncio.run(hold())
        except BaseException as exc:  # reported to the test below
            failure.append(exc)
            held.set()

    thread = threading.Thread(target=run, name="catalog-lock")
    thread.start()
    held.wait(30)
    try:
        if failure:
            raise failure[0]
        yield
    finally:
        release.set()
        thread.join(30)


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    """``sql`` on a connection of its own (a read while the lock is held)."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(_sqlite_path(url), timeout=30)
        try:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
        finally:
            conn.close()

    async def fetch() -> list[tuple[Any, ...]]:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    found: list[list[tuple[Any, ...]]] = []
    thread = threading.Thread(target=lambda: found.append(asyncio.run(fetch())))
    thread.start()
    thread.join(30)
    return found[0]
