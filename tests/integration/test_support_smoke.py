"""Smoke tests of the test support itself: SeaweedFS and PostgreSQL helpers work.

If these fail, every integration test would fail for a reason that has
nothing to do with tierckpt; they say so plainly.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from devsupport import postgres as pg
from devsupport.seaweed import SeaweedServer, boto3_client


def test_seaweed_put_get_survives_restart(tmp_path: Path) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)  # several filer chunks
    with SeaweedServer(tmp_path / "weed") as server:
        first_ports = dict(server.ports)
        bucket = server.create_bucket("smoke-bucket")
        client = boto3_client(server.endpoint_url)
        client.put_object(Bucket=bucket, Key="run/step-1/weights.bin", Body=payload)

        got = client.get_object(Bucket=bucket, Key="run/step-1/weights.bin")["Body"].read()
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()

        server.restart()
        assert server.ports == first_ports
        after_stop = client.get_object(Bucket=bucket, Key="run/step-1/weights.bin")
        assert after_stop["Body"].read() == payload

        # A crash (SIGKILL) keeps acknowledged data too, and new writes do
        # not overwrite old objects (the file-id sequence must not restart).
        server.restart(hard=True)
        client.put_object(Bucket=bucket, Key="run/step-2/weights.bin", Body=b"second")
        assert client.get_object(Bucket=bucket, Key="run/step-1/weights.bin")["Body"].read() == (
            payload
        )
        assert client.get_object(Bucket=bucket, Key="run/step-2/weights.bin")["Body"].read() == (
            b"second"
        )
        assert server.start_seconds is not None and server.start_seconds < 60
    assert not server.running


def test_session_fixtures_give_isolated_buckets(
    seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    assert len(s3_bucket) >= 3
    assert s3_client.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0
    s3_client.put_object(Bucket=s3_bucket, Key="a", Body=b"x")
    assert s3_client.head_object(Bucket=s3_bucket, Key="a")["ContentLength"] == 1
    assert seaweed.endpoint_url.startswith("http://127.0.0.1:")


async def _tables(url: str) -> list[str]:
    conn = await asyncpg.connect(pg.asyncpg_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
        )
        return [row["tablename"] for row in rows]
    finally:
        await conn.close()


async def _exists(admin_url: str, name: str) -> bool:
    conn = await asyncpg.connect(pg.asyncpg_dsn(admin_url))
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


@pytest.mark.postgres
def test_postgres_temp_database_create_and_drop(postgres_admin_url: str) -> None:
    url = pg.create_temp_database(postgres_admin_url)
    name = url.rsplit("/", 1)[-1]
    assert url.startswith("postgresql+asyncpg://")
    assert name.startswith(pg.TEMP_PREFIX)
    try:
        assert asyncio.run(_exists(postgres_admin_url, name))

        async def make_table() -> None:
            conn = await asyncpg.connect(pg.asyncpg_dsn(url))
            try:
                await conn.execute("CREATE TABLE leftover (id int)")
            finally:
                await conn.close()

        asyncio.run(make_table())
        assert asyncio.run(_tables(url)) == ["leftover"]
        pg.reset_database(url)
        assert asyncio.run(_tables(url)) == []
    finally:
        pg.drop_database(url, postgres_admin_url)
    assert not asyncio.run(_exists(postgres_admin_url, name))


def test_catalog_url_is_empty_and_usable(catalog_url: str) -> None:
    if catalog_url.startswith("sqlite"):
        path = Path(catalog_url.removeprefix("sqlite+aiosqlite:///"))
        assert path.is_absolute() and not path.exists()
        return
    assert catalog_url.startswith("postgresql+asyncpg://")
    assert asyncio.run(_tables(catalog_url)) == []

    async def leave_a_table() -> None:
        conn = await asyncpg.connect(pg.asyncpg_dsn(catalog_url))
        try:
            await conn.execute(f"CREATE TABLE t_{uuid.uuid4().hex[:8]} (id int)")
        finally:
            await conn.close()

    # The next test's reset removes it; within this test it is visible.
    asyncio.run(leave_a_table())
    assert len(asyncio.run(_tables(catalog_url))) == 1


def test_postgres_rule_skips_or_fails_when_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    unreachable = "postgresql+asyncpg://nobody@127.0.0.1:1/none"
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="TIERCKPT_TEST_POSTGRES_URL"):
        pg.require_postgres(unreachable)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="must run in CI"):
        pg.require_postgres(unreachable)
