"""One checkpoint of a run at a step; its shards, files and replicas hang off it."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.sql.expression import false

from .base import Base, not_null, utcnow


class CheckpointState(enum.StrEnum):
    REGISTERED = "registered"
    UPLOADING = "uploading"
    DURABLE = "durable"
    REPLICATED = "replicated"
    FAILED = "failed"
    CORRUPT = "corrupt"
    DELETED = "deleted"


# States in which a checkpoint is a candidate for `latest` (validity is then
# decided by its committed, non-corrupt replicas).
VALID_STATES = (CheckpointState.DURABLE, CheckpointState.REPLICATED)
# States a checkpoint never leaves: it failed (never became valid) or was
# deleted. Nothing is uploaded, verified, replicated or copied for it any more.
ENDED_STATES = (CheckpointState.FAILED, CheckpointState.DELETED)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        # Checkpoints of a run in a state. (`latest` itself walks the
        # (run_id, step) unique index backwards, highest step first: EXPLAIN
        # on both databases, tests/integration/test_latest_catalog.py.)
        Index("ix_checkpoints_latest", "run_id", "state", "step"),
        # A checkpoint's children (lineage, and every detail and `latest`
        # answer) are looked up by their parent; only those that have one.
        Index("ix_checkpoints_parent", "parent_run", "parent_step", **not_null("parent_run")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default=CheckpointState.REGISTERED)
    world_size: Mapped[int] = mapped_column(Integer, default=1)
    epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    priority: Mapped[str] = mapped_column(String(16), default="normal")
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    parent_run: Mapped[str | None] = mapped_column(String(128), nullable=True)
    parent_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    write_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    file_count: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)
    durable_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # Retention never deletes a pinned checkpoint (nor the ancestors it needs).
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Marked bad by a person (e.g. training diverged from it): `latest` skips it.
    quarantined_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    quarantine_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    deleted_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
