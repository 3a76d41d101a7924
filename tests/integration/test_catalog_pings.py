"""The catalog engine's connections on PostgreSQL: pinged only after sitting
idle (db._ping_when_idle), not before every transaction, and still replaced
when the server has dropped them; under light use the connection used last is
handed out again, so it stays warm.

Through asyncpg a checkout ping is three round trips (BEGIN, the ping,
ROLLBACK); the worker and the background passes open a transaction per
step of every job, so the main engine pings only connections idle longer
than ``db.PING_AFTER_IDLE``, as the read pool and the registration writer do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from devsupport import postgres as pg
from tierckpt.service import db

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True),
]


def count_pings(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the dialect's ping on ``engine``, counted in a one-item list."""
    pings = [0]
    ping: Callable[[Any], Any] = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> Any:
        pings[0] += 1
        return ping(dbapi_connection)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    return pings


async def one_transaction(engine: AsyncEngine) -> int:
    async with engine.begin() as connection:
        return int((await connection.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def test_connections_in_use_are_not_pinged_idle_ones_are(
    catalog_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "PING_AFTER_IDLE", 0.3)
    engine = db.create_engine(catalog_url, bounded=True)
    pings = count_pings(engine, monkeypatch)
    try:
        backends = {await one_transaction(engine) for _ in range(20)}
        assert pings[0] == 0, "a connection used a moment ago was pinged"
        assert len(backends) == 1, "one pooled connection served the sequential transactions"
        await asyncio.sleep(0.5)  # longer than PING_AFTER_IDLE
        await one_transaction(engine)
        assert pings[0] == 1, "a connection idle past PING_AFTER_IDLE was not pinged"
    finally:
        await engine.dispose()


async def test_light_use_keeps_one_connection_warm_after_the_pool_grew(
    catalog_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool that grew under a burst, then used one transaction at a time
    (an idle worker's claims): the connection used last is handed out again
    and stays warm. Handed out oldest first, each of the burst's connections
    would sit idle past PING_AFTER_IDLE between turns and be pinged."""
    monkeypatch.setattr(db, "PING_AFTER_IDLE", 0.5)
    engine = db.create_engine(catalog_url, bounded=True)
    pings = count_pings(engine, monkeypatch)
    try:

        async def held(seconds: float) -> None:
            async with engine.begin() as connection:
                await connection.execute(text("SELECT pg_sleep(:s)"), {"s": seconds})

        await asyncio.gather(*(held(0.1) for _ in range(4)))  # the pool holds 4
        await asyncio.sleep(0.6)  # all four idle past PING_AFTER_IDLE
        backends = []
        for _ in range(8):
            backends.append(await one_transaction(engine))
            await asyncio.sleep(0.2)
        assert pings[0] == 1, "only the first light-use checkout follows an idle spell"
        assert len(set(backends)) == 1, "one connection served the light use"
    finally:
        await engine.dispose()


async def test_a_connection_the_server_dropped_is_replaced(catalog_url: str) -> None:
    engine = db.create_engine(catalog_url, bounded=True)
    try:
        before = await one_transaction(engine)
        assert pg.terminate_connections(catalog_url) >= 1
        await asyncio.sleep(0.2)  # the socket's end reaches the event loop
        # Known closed at checkout (no ping needed): a fresh connection, no error.
        after = await one_transaction(engine)
        assert after != before
    finally:
        await engine.dispose()
