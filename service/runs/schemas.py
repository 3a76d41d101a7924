"""Bodies of the run endpoints."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, field_serializer

from ..checkpoints.schemas import _iso


class RunOut(BaseModel):
    run: str
    checkpoints: int
    latest_step: int | None
    created_at: datetime

    @field_serializer("created_at")
    def _ts(self, value: datetime) -> str | None:
        return _iso(value)


class RunPage(BaseModel):
    runs: list[RunOut]
    total: int
