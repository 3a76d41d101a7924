"""The agent supervises its background components: one that dies is logged
and makes ``/healthz`` fail (an orchestrator restarts the agent), instead of
leaving an agent that answers but no longer uploads."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from devsupport.agent import Agent, running_agent
from tierckpt.service.jobs.worker import Worker
from tierckpt.service.periodic import Periodic


async def unhealthy(agent: Agent, timeout: float = 10.0) -> dict[str, str]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        answer = await agent.http.get("/healthz")
        if answer.status_code != 200:
            assert answer.status_code == 503
            error: dict[str, str] = answer.json()["error"]
            return error
        assert asyncio.get_running_loop().time() < deadline, "the agent stayed healthy"
        await asyncio.sleep(0.02)


async def test_a_healthy_agent_closes_without_a_failure(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        assert (await agent.http.get("/healthz")).json() == {"status": "ok"}
        process = agent.process
        assert process.worker is not None
        assert [p.name for p in process.passes] == ["scrub", "peers", "retention"]
    assert process.failures == []


async def test_a_dead_worker_is_logged_and_fails_the_liveness_probe(
    catalog_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken_loop(self: Worker) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Worker, "_claim_loop", broken_loop)
    with caplog.at_level(logging.ERROR, logger="tierckpt.agent"):
        async with running_agent(catalog_url, tmp_path) as agent:
            error = await unhealthy(agent)
            assert error["code"] == "agent_component_died"
            assert "worker (RuntimeError: boom)" in error["message"]
            # Still answering the API (a restart is the orchestrator's call).
            assert (await agent.http.get("/v1/runs")).status_code == 200
    died = [r for r in caplog.records if "worker died" in r.getMessage()]
    assert len(died) == 1 and died[0].exc_info is not None


async def test_a_dead_lease_heartbeat_stops_the_worker_and_is_seen(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_heartbeat(self: Worker) -> None:
        raise ValueError("heartbeat bug")

    monkeypatch.setattr(Worker, "_heartbeat", broken_heartbeat)
    async with running_agent(catalog_url, tmp_path) as agent:
        error = await unhealthy(agent)
        assert "worker (RuntimeError: the lease heartbeat died)" in error["message"]
        assert agent.process.worker is not None and agent.process.worker.busy == 0


async def test_a_dead_periodic_pass_is_seen(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_run(self: Periodic) -> None:
        raise RuntimeError(f"{self.name} loop bug")

    monkeypatch.setattr(Periodic, "run", broken_run)
    async with running_agent(catalog_url, tmp_path) as agent:
        await unhealthy(agent)
        for _ in range(500):
            if len(agent.process.failures) == 3:
                break
            await asyncio.sleep(0.01)
        # Only the passes: the worker itself still runs.
        assert [f.component for f in agent.process.failures] == [
            "scrub pass",
            "peers pass",
            "retention pass",
        ]
        message = (await agent.http.get("/healthz")).json()["error"]["message"]
        assert "scrub pass (RuntimeError: scrub loop bug)" in message
        assert "retention pass (RuntimeError: retention loop bug)" in message
