"""The catalog (PostgreSQL) briefly unreachable, through a real TCP proxy.

During the outage /readyz says so (503), the API answers 503 with the JSON
error shape (never a 500, never a 2xx for work that was not recorded), the
worker pauses without dying or spinning; afterwards everything resumes and a
checkpoint registered just before the outage still becomes durable.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import httpx
import pytest

from devsupport.agent import Agent, running_agent, write_checkpoint
from devsupport.tcpproxy import TcpProxy
from tierckpt.service import db

pytestmark = pytest.mark.postgres


def assert_catalog_503(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "catalog_unavailable", answer.text
    assert answer.json()["error"]["message"]


async def eventually(agent: Agent, url: str, check, timeout: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        answer = await agent.http.get(url)
        if check(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: {answer.status_code} {answer.text[:300]}")
        await asyncio.sleep(0.1)


async def test_catalog_outage_is_503_and_work_resumes(
    proxied_catalog: tuple[str, TcpProxy], tmp_path: Path
) -> None:
    catalog_url, proxy = proxied_catalog
    async with running_agent(
        catalog_url, tmp_path, worker={"poll_interval": 0.2, "lease_seconds": 4}
    ) as agent:
        before = write_checkpoint(agent.ssd / "s1", {"w.bin": 24 << 20, "meta": b"m"})
        after = write_checkpoint(agent.ssd / "s2", {"w.bin": 1 << 20})
        registered = await agent.register("r", 1, before)
        assert registered.status_code == 202, registered.text
        # (With register_ack = "recorded", in the catalog a moment after the
        # answer: a record the outage holds back is answered from the record
        # instead, test_register_inbox.py.)
        await agent.in_catalog("r")
        # Cut at once: the upload is in flight (or not even claimed yet).
        proxy.cut()
        assert agent.process.worker is not None
        worker_task = agent.process.worker._main
        assert worker_task is not None

        ready = await agent.http.get("/readyz")
        assert_catalog_503(ready)
        assert_catalog_503(await agent.http.get("/v1/runs/r/checkpoints/1"))
        assert_catalog_503(await agent.http.get("/v1/runs/r/latest"))
        assert_catalog_503(await agent.http.get("/v1/runs"))
        refused = await agent.register("r", 2, after)
        assert_catalog_503(refused)
        assert refused.headers["retry-after"]
        assert (await agent.http.get("/healthz")).status_code == 200  # alive, not ready

        # The worker pauses: alive, and not hammering the catalog.
        refused_before = proxy.refused
        await asyncio.sleep(3)
        attempts = proxy.refused - refused_before
        assert not worker_task.done(), "the worker died during the outage"
        # Claims back off while the catalog stays away (0.4, 0.8, 1.6, 3.2 s
        # after a 0.2 s poll interval): a handful in 3 s, where a claim every
        # poll interval made 14.
        assert attempts <= 6, f"{attempts} connection attempts in 3 s"

        proxy.restore()
        await eventually(agent, "/readyz", lambda a: a.status_code == 200, timeout=30)
        done = await eventually(
            agent,
            "/v1/runs/r/checkpoints/1",
            lambda a: a.status_code == 200 and a.json()["state"] in ("durable", "failed"),
            timeout=90,
        )
        assert done.json()["state"] == "durable", done.text
        files = {f["path"]: f["sha256"] for f in done.json()["files"]}
        assert files["w.bin"] == hashlib.sha256((before / "w.bin").read_bytes()).hexdigest()
        region = tmp_path / "region-local" / "r" / "step-000000000001"
        assert (region / "MANIFEST.json").is_file()

        # The refused registration left nothing behind; it can be made now.
        missing = await agent.http.get("/v1/runs/r/checkpoints/2")
        assert missing.status_code == 404
        assert (await agent.register("r", 2, after)).status_code == 202
        await agent.wait_state("r", 2, timeout=60)
        latest = (await agent.http.get("/v1/runs/r/latest")).json()
        assert latest["step"] == 2
        assert not worker_task.done()


async def test_outage_during_a_request_is_503_not_a_lost_2xx(
    proxied_catalog: tuple[str, TcpProxy], tmp_path: Path
) -> None:
    """Connections already pooled die with the outage: still a clean 503."""
    catalog_url, proxy = proxied_catalog
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        # Warm the pool so the next requests reuse live connections.
        for _ in range(3):
            assert (await agent.http.get("/v1/runs")).status_code == 200
        proxy.cut()
        for _ in range(3):
            assert_catalog_503(await agent.register("r", 1, ckpt))
            assert_catalog_503(await agent.http.get("/v1/runs"))
        proxy.restore()
        await eventually(agent, "/v1/runs", lambda a: a.status_code == 200, timeout=30)
        assert (await agent.http.get("/v1/runs")).json()["total"] == 0
        assert (await agent.register("r", 1, ckpt)).status_code == 202


async def test_partitioned_catalog_is_503_within_the_timeouts(
    proxied_catalog: tuple[str, TcpProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition (no reset, no answer: the proxy holds every byte) is the
    outage a client cannot see coming. Pooled connections hang on their
    statements and new ones on their connect: the catalog timeouts turn both
    into a 503 (and a paused worker) instead of requests held for ever."""
    monkeypatch.setattr(db, "CONNECT_TIMEOUT", 1.0)
    monkeypatch.setattr(db, "STATEMENT_TIMEOUT", 2.0)
    catalog_url, proxy = proxied_catalog
    async with running_agent(
        catalog_url, tmp_path, worker={"poll_interval": 0.2, "lease_seconds": 4}
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        for _ in range(3):  # pooled, recently used connections: no ping
            assert (await agent.http.get("/v1/runs/r/latest")).status_code == 404
        assert agent.process.worker is not None
        worker_task = agent.process.worker._main
        assert worker_task is not None

        proxy.stall()
        try:
            for request in (
                agent.http.get("/v1/runs/r/latest"),
                agent.http.get("/v1/runs"),
                agent.register("r", 1, ckpt),
                agent.http.get("/readyz"),
            ):
                began = time.monotonic()
                answer = await asyncio.wait_for(request, 30)
                assert_catalog_503(answer)
                # A statement timeout (2 s), then maybe a connect timeout (1 s)
                # and the one retry of a read, not 60 s or for ever without them.
                assert time.monotonic() - began < 12, time.monotonic() - began
            assert not worker_task.done(), "the worker died during the partition"
        finally:
            proxy.restore()  # also on failure: the agent's shutdown needs its catalog
        await eventually(agent, "/v1/runs/r/latest", lambda a: a.status_code == 404, timeout=30)
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await agent.wait_state("r", 1, timeout=60)
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 1
