"""No catalog write transaction is held while the object store hangs.

The S3 region is reached through a TCP proxy that is stalled (a network
partition: every byte held, connections left open) while an upload is in
flight. The upload's request then hangs; meanwhile the catalog must stay
free for the trainer's critical path: registrations and `latest` complete,
on SQLite nobody holds the database's write lock (another connection takes
it at once), on PostgreSQL no catalog session sits idle inside a
transaction. A job that kept its transaction open across the store call
would hold the lock (SQLite) or its transaction (PostgreSQL) for the whole
partition.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from devsupport import postgres as pg
from devsupport.agent import Agent, running_agent, s3_region, write_checkpoint
from devsupport.seaweed import SeaweedServer
from devsupport.tcpproxy import TcpProxy

# Long enough that a transaction held across the hung request would be
# seen by every check below; the checks themselves are functional bounds.
STALL_SECONDS = 4.0
ANSWER_WITHIN = 10.0


@pytest.fixture
def store_proxy(seaweed: SeaweedServer) -> Iterator[TcpProxy]:
    with TcpProxy(seaweed.host, seaweed.ports["s3"]) as proxy:
        yield proxy


async def _upload_running(agent: Agent, run: str, step: int) -> None:
    for _ in range(400):
        detail = (await agent.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
        if any(j["kind"] == "upload" and j["state"] == "running" for j in detail["jobs"]):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"the upload of {run}/{step} never started: {detail}")


def _sqlite_write_lock_free(path: str) -> None:
    """Take SQLite's write lock from another connection, waiting at most a
    second: a transaction held across the stalled request would keep it."""
    conn = sqlite3.connect(path, timeout=1.0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def _postgres_idle_in_transaction(url: str) -> list[dict[str, Any]]:
    """Catalog sessions idle inside a transaction for more than a second."""
    conn = await asyncpg.connect(pg.asyncpg_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT pid, state, now() - state_change AS idle, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND state LIKE 'idle in transaction%' AND now() - state_change > interval '1 second'"
        )
        return [dict(r) for r in rows]
    finally:
        await conn.close()


async def test_register_and_latest_go_on_while_an_upload_hangs_on_the_store(
    catalog_url: str,
    tmp_path: Path,
    s3_bucket: str,
    store_proxy: TcpProxy,
) -> None:
    proxied = f"http://127.0.0.1:{store_proxy.port}"
    regions = [s3_region("east", proxied, s3_bucket)]
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        # A durable checkpoint first, so `latest` has something to answer.
        first = write_checkpoint(agent.ssd / "s1", {"w.bin": 64 << 10})
        assert (await agent.register("r", 1, first)).status_code == 202
        await agent.wait_state("r", 1, timeout=60)

        store_proxy.stall()
        try:
            big = write_checkpoint(agent.ssd / "s2", {"w.bin": 24 << 20, "b": b"b"})
            assert (await agent.register("r", 2, big)).status_code == 202
            await _upload_running(agent, "r", 2)
            await asyncio.sleep(STALL_SECONDS / 2)  # the upload's request is hung now

            for step in range(3, 8):
                tiny = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": 4096})
                answer = await asyncio.wait_for(agent.register("r", step, tiny), ANSWER_WITHIN)
                assert answer.status_code == 202, answer.text
                latest = await asyncio.wait_for(agent.http.get("/v1/runs/r/latest"), ANSWER_WITHIN)
                assert latest.status_code == 200, latest.text
                assert latest.json()["step"] == 1

            if make_url(catalog_url).get_backend_name() == "sqlite":
                database = make_url(catalog_url).database
                assert database is not None
                await asyncio.to_thread(_sqlite_write_lock_free, database)
            else:
                held = await _postgres_idle_in_transaction(catalog_url)
                assert not held, f"catalog transactions held while the store hangs: {held}"

            detail = (await agent.http.get("/v1/runs/r/checkpoints/2")).json()
            assert detail["state"] in ("registered", "uploading"), detail["state"]
        finally:
            store_proxy.restore()
        # Once the store answers again, everything becomes durable.
        for step in range(2, 8):
            await agent.wait_state("r", step, timeout=120)
