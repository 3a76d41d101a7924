"""Bodies of the prefetch endpoints."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from ..checkpoints.schemas import MAX_STEP, iso_timestamp
from ..names import NAME_CHARS, RUN_NAME

# Most nodes one request names: a large job's allocation, not a whole fleet.
MAX_NODES = 4096


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: list[str] = Field(min_length=1, max_length=MAX_NODES)
    """The nodes (their agents' ``[server] node``) that should hold the checkpoint."""
    step: int | None = Field(None, ge=0, le=MAX_STEP)
    """Default: the run's latest valid checkpoint."""

    @field_validator("nodes")
    @classmethod
    def _valid_nodes(cls, nodes: list[str]) -> list[str]:
        for node in nodes:
            if not RUN_NAME.match(node):
                raise ValueError(
                    f"node name {node[:140]!r} is invalid: {NAME_CHARS}, not '.' or '..'"
                )
        return list(dict.fromkeys(nodes))  # each node once, in the order given


class PrefetchJobOut(BaseModel):
    """One node's prefetch job. ``state``: queued, running, succeeded or failed
    (``error`` says why; a queued job with an error is waiting to retry)."""

    id: int
    run: str
    step: int
    node: str
    state: str
    attempts: int
    error: str | None
    created_at: datetime
    finished_at: datetime | None

    @field_serializer("created_at", "finished_at")
    def _ts(self, value: datetime | None) -> str | None:
        return iso_timestamp(value)


class PrefetchOut(BaseModel):
    run: str
    step: int
    jobs: list[PrefetchJobOut]


class PrefetchPage(BaseModel):
    run: str
    jobs: list[PrefetchJobOut]
