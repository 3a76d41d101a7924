"""The agents catalog: each agent's row, its heartbeat, and who is alive.

An agent upserts its row at start (``announce``) and refreshes the heartbeat
from its peer pass; ``live`` is every agent heard from within ``[peers]
lease_seconds``. Clocks: every timestamp is the writing agent's UTC clock,
so agents sharing a catalog need roughly synchronised clocks (NTP), as the
job leases already do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from ..config import Settings
from ..db import dialect_name
from ..models import AgentRow, utcnow


@dataclass(frozen=True)
class AgentInfo:
    node: str
    url: str
    failure_domain: str
    started_at: datetime
    heartbeat_at: datetime
    live: bool


async def announce(session: AsyncSession, settings: Settings) -> None:
    """This agent's row, as configured now (a restart may move it)."""
    now = utcnow()
    server = settings.server
    dialect = postgresql if dialect_name(session) == "postgresql" else sqlite
    values = {
        "node": server.node,
        "url": server.url,
        "failure_domain": server.domain,
        "started_at": now,
        "heartbeat_at": now,
    }
    statement = dialect.insert(AgentRow).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=["node"],
        set_={k: v for k, v in values.items() if k != "node"},
    )
    await session.execute(statement)


async def heartbeat(session: AsyncSession, settings: Settings) -> None:
    result = await session.execute(
        update(AgentRow).where(AgentRow.node == settings.server.node).values(heartbeat_at=utcnow())
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        # The row is gone (a catalog rebuilt): say who we are again.
        await announce(session, settings)


def is_live(heartbeat_at: datetime, lease_seconds: float, now: datetime | None = None) -> bool:
    return heartbeat_at > (now or utcnow()) - timedelta(seconds=lease_seconds)


async def all_agents(session: AsyncSession, lease_seconds: float) -> list[AgentInfo]:
    now = utcnow()
    rows = await session.scalars(select(AgentRow).order_by(AgentRow.node))
    return [
        AgentInfo(
            node=row.node,
            url=row.url,
            failure_domain=row.failure_domain,
            started_at=row.started_at,
            heartbeat_at=row.heartbeat_at,
            live=is_live(row.heartbeat_at, lease_seconds, now),
        )
        for row in rows
    ]


async def live_agents(session: AsyncSession, lease_seconds: float) -> dict[str, AgentInfo]:
    """Live agents by node."""
    return {a.node: a for a in await all_agents(session, lease_seconds) if a.live}
