"""Bodies of the run endpoints."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, field_serializer


class RunOut(BaseModel):
    run: str
    checkpoints: int
    latest_step: int | None
    created_at: datetime

    @field_serializer("created_at")
    def _ts(self, value: datetime) -> str:
        return value.isoformat(timespec="milliseconds") + "Z"


class RunPage(BaseModel):
    runs: list[RunOut]
    total: int
