"""Agents record themselves in the catalog and heartbeat; a silent one drops out."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from devsupport.agent import running_agent
from tierckpt.service.db import transaction
from tierckpt.service.models import AgentRow, utcnow


async def test_an_agent_announces_itself_heartbeats_and_expires(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(
        catalog_url,
        tmp_path,
        server={"node": "node-x", "failure_domain": "rack-1", "advertise_url": "http://x:81/"},
        peers={"interval_seconds": 0.05, "lease_seconds": 5},
    ) as agent:

        async def listed() -> list[dict[str, object]]:
            answer = await agent.http.get("/v1/agents")
            assert answer.status_code == 200, answer.text
            return list(answer.json()["agents"])

        for _ in range(400):
            if await listed():
                break
            await asyncio.sleep(0.02)
        (row,) = await listed()
        assert row["node"] == "node-x" and row["live"] is True
        assert row["url"] == "http://x:81" and row["failure_domain"] == "rack-1"
        first = row["heartbeat_at"]

        # Another agent, silent for longer than the lease: listed, not live.
        async with transaction(agent.resources.sessionmaker) as session:
            old = utcnow() - timedelta(seconds=60)
            session.add(
                AgentRow(
                    node="node-gone",
                    url="http://gone:1",
                    failure_domain="rack-2",
                    started_at=old,
                    heartbeat_at=old,
                )
            )
        for _ in range(400):
            rows = {r["node"]: r for r in await listed()}
            if rows["node-x"]["heartbeat_at"] != first:
                break
            await asyncio.sleep(0.02)
        assert rows["node-x"]["heartbeat_at"] != first  # the heartbeat moves on
        assert rows["node-gone"]["live"] is False

        # Its heartbeat back: live again.
        async with transaction(agent.resources.sessionmaker) as session:
            await session.execute(
                update(AgentRow).where(AgentRow.node == "node-gone").values(heartbeat_at=utcnow())
            )
        rows = {r["node"]: r for r in await listed()}
        assert rows["node-gone"]["live"] is True
