"""One rank's part of a checkpoint, as registered from one node's local SSD."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import Boolean, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.sql.expression import true

from .base import Base, utcnow


class ShardState(enum.StrEnum):
    REGISTERED = "registered"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    FAILED = "failed"


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("checkpoint_id", "rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through the (checkpoint_id, rank) unique index.
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(255))
    path: Mapped[str] = mapped_column(Text)
    # True when a directory was registered (its files are all the checkpoint);
    # False for a single file, whose directory belongs to the trainer.
    is_directory: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    state: Mapped[str] = mapped_column(String(16), default=ShardState.REGISTERED)
    # SHA-256 over the registered file list (path, size, mtime, client hash):
    # decides whether a repeated registration is the same content (200) or not (409).
    fingerprint: Mapped[str] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    uploaded_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # When T0 retention removed the files from the node's SSD.
    evicted_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
