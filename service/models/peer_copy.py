"""A copy of one shard held by another agent (a peer) under its own T0.

One row per (shard, node). A checkpoint's copy on a peer node, as shown in
its detail view (``peer:<node>``), is the set of the rows of its shards on
that node (peers/state.py says how their states combine).
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, utcnow


class PeerCopyState(enum.StrEnum):
    PENDING = "pending"  # being pushed
    COMMITTED = "committed"  # every file arrived, hashed equal to the catalog's
    CORRUPT = "corrupt"  # a re-read (scrub) disagreed: removed, a new copy is due
    DELETED = "deleted"  # evicted by the peer retention


class PeerCopy(Base):
    __tablename__ = "peer_copies"
    __table_args__ = (UniqueConstraint("shard_id", "node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through the (shard_id, node) unique index.
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    # Denormalised from the shard: a checkpoint's copies are read in one query.
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True
    )
    node: Mapped[str] = mapped_column(String(255), index=True)
    # The copy's directory on that node (under its first T0 root).
    path: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default=PeerCopyState.PENDING)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    committed_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    verified_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
