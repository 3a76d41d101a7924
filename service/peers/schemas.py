"""Bodies of the agents and peer endpoints (docs/API.md)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, field_serializer

from ..checkpoints.schemas import iso_timestamp


class AgentOut(BaseModel):
    node: str
    url: str
    failure_domain: str
    started_at: datetime
    heartbeat_at: datetime
    live: bool

    @field_serializer("started_at", "heartbeat_at")
    def _ts(self, value: datetime) -> str | None:
        return iso_timestamp(value)


class AgentList(BaseModel):
    agents: list[AgentOut]


class ReceivedFile(BaseModel):
    path: str
    size: int


class CommittedCopy(BaseModel):
    shard_id: int
    node: str
    path: str
