"""A training run: the namespace checkpoints are numbered in."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, utcnow


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    # Per-run retention override (PUT /v1/runs/{run}/retention); None = server default.
    retention: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
