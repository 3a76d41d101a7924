"""A checkpoint's copy in one region (T1 primary or T2 other regions)."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, utcnow


class ReplicaState(enum.StrEnum):
    PENDING = "pending"
    COMMITTED = "committed"
    CORRUPT = "corrupt"
    DELETED = "deleted"


class Replica(Base):
    __tablename__ = "replicas"
    __table_args__ = (UniqueConstraint("checkpoint_id", "region"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through the (checkpoint_id, region) unique index.
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    region: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default=ReplicaState.PENDING)
    uri: Mapped[str] = mapped_column(Text)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    committed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    verified_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
