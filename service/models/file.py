"""One file of a shard: what was registered, and the hash the upload computed."""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .base import Base, not_null


class File(Base):
    __tablename__ = "files"
    __table_args__ = (
        UniqueConstraint("shard_id", "path"),
        # Dedup asks "is a file with this SHA-256 already committed in the
        # region?" for every large file it may skip (service/uploads/dedup.py).
        # Only hashed files: a registration writes one B-tree page less.
        Index("ix_files_sha256", "sha256", **not_null("sha256")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Looked up through the (shard_id, path) unique index, which leads with it.
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    # Relative to the shard's directory, POSIX separators.
    path: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)
    # Given by the client at registration; the upload must reproduce it.
    expected_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Computed by the upload while streaming the bytes; None until then.
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The SHA-256 of every chunk_size chunk, hex digests concatenated
    # (storage/chunks.py), from the same read: a reader verifies the byte
    # ranges it reads with them. None: uploaded before chunks were hashed.
    chunk_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    chunk_sha256: Mapped[str | None] = mapped_column(Text, nullable=True)
