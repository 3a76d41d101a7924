"""Bodies of the run endpoints."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, field_serializer

from ..checkpoints.schemas import iso_timestamp


class RunRegionOut(BaseModel):
    """Where the run restarts from in one region: its newest valid checkpoint
    committed there (``created_at``: when it was registered)."""

    region: str
    step: int
    created_at: datetime

    @field_serializer("created_at")
    def _ts(self, value: datetime) -> str | None:
        return iso_timestamp(value)


class RunOut(BaseModel):
    run: str
    checkpoints: int
    latest_step: int | None
    created_at: datetime
    # One entry per region holding a valid checkpoint of the run (config order).
    regions: list[RunRegionOut] = []

    @field_serializer("created_at")
    def _ts(self, value: datetime) -> str | None:
        return iso_timestamp(value)


class RunPage(BaseModel):
    runs: list[RunOut]
    total: int
