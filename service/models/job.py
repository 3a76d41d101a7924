"""Background work, kept in the catalog so a killed agent loses none of it."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, utcnow


class JobKind(enum.StrEnum):
    """Stored as a plain string; each kind's payload and retry policy are in
    ``jobs/kinds.py``."""

    UPLOAD = "upload"  # one shard, local SSD -> primary region; bound to the shard's node
    COMMIT = "commit"  # write a region's MANIFEST.json once every shard is there
    REPLICATE = "replicate"  # copy a committed checkpoint into another region (or repair one)
    VERIFY = "verify"  # re-read a region's objects and re-hash them
    DELETE = "delete"  # remove a checkpoint from every region (manifest first)
    RETAIN = "retain"  # apply a run's retention once a checkpoint of it is durable; per node
    # Copy one shard's T0 files to peer agents ([peers] copies); bound to the shard's node.
    PEER_PUSH = "peer_push"
    PREFETCH = "prefetch"  # bring a valid checkpoint into a node's T0 before a restart; per node


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


PRIORITY = {"normal": 0, "urgent": 100}


def priority_of(checkpoint_priority: str) -> int:
    """The claim priority of a checkpoint's jobs (unknown names: normal)."""
    return PRIORITY.get(checkpoint_priority, 0)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # The claim query: runnable jobs, best priority then oldest.
        Index("ix_jobs_claim", "state", "priority", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True
    )
    shard_id: Mapped[int | None] = mapped_column(
        ForeignKey("shards.id", ondelete="CASCADE"), nullable=True
    )
    region: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # Only the agent of this node may run the job (it reads that node's SSD).
    node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Set while the job is active and cleared when it ends: a unique index on a
    # nullable column gives "at most one active job per (kind, checkpoint,
    # shard, region)" on both SQLite and PostgreSQL.
    dedupe_key: Mapped[str | None] = mapped_column(String(255), nullable=True, unique=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=10)
    run_after: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    lease_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
