"""One agent (node) sharing the catalog: where peers reach it and whether it lives.

Each agent upserts its row at start and refreshes ``heartbeat_at`` from its
periodic pass; an agent whose heartbeat is older than ``[peers]
lease_seconds`` counts as dead (it is never deleted: a node may come back).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, utcnow


class AgentRow(Base):
    __tablename__ = "agents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(255), unique=True)
    # The base URL other agents push peer copies to and clients read them from.
    url: Mapped[str] = mapped_column(Text)
    # Peer copies go to agents of other failure domains (a rack, a zone).
    failure_domain: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
