"""Deduplicate unchanged files: copy them server-side instead of sending them again.

Most checkpoints of a run repeat many files byte for byte (frozen layers, an
embedding table, tokenizer and data-loader state). A file whose SHA-256 and
size equal a file already committed in the region is copied from that object
into the new checkpoint's own key (CopyObject / UploadPartCopy on S3, an
in-kernel copy on POSIX), so the layout stays plain (every step is a full,
independent set of objects; deleting the older step later does not touch it)
and only the changed bytes cross the network.

Finding the duplicates must not cost new data a second read:

- the client gave the file's SHA-256 at registration: the catalog is asked
  directly, and only a hit costs a local read (to hash the bytes; nothing is
  sent, so it is still one read of the file);
- otherwise only a file with the same relative path and size as a file of one
  of the run's last few valid checkpoints (same rank) is a candidate. A
  candidate is first probed: a few small ranges of the local file are compared
  with the same ranges of the earlier object (``PROBES`` × ``PROBE_BYTES``
  fetched from the store). Updated weights differ in every range, so a file
  that changed in place is rejected after kilobytes and uploaded with its one
  read; only a file whose probes all match is hashed before the copy.

What the catalog records for a copied file is always the hash of the *local*
bytes, computed here with the same open-file, size and mtime checks as the
upload (``source.py``), never a hash taken from the catalog on trust. Any
failure of the dedup path (source object deleted by retention meanwhile,
store error, catalog error) falls back to the normal upload: dedup can only
save work, never fail a checkpoint. A local file that changed since
registration fails exactly as it would in the upload.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ..db import reading
from ..models import VALID_STATES, Checkpoint, File, Replica, ReplicaState, Run, Shard
from ..storage import layout
from ..storage.base import ObjectStore, StoreError
from ..storage.chunks import DEFAULT_CHUNK_SIZE, FileHashes
from .pipeline import UploadedFile
from .source import SourceChanged, SourceFile, check_unchanged, open_checked

log = logging.getLogger("tierckpt.dedup")

# Below this a PUT costs about what a copy, its HEAD and a catalog query cost:
# small files are always sent.
MIN_DEDUP_BYTES = 1024 * 1024
# Candidates by (path, size) come from this many of the run's newest valid
# checkpoints: the previous step is by far the likeliest to share files.
RECENT_CHECKPOINTS = 3
# Objects with the same content tried in turn (newest first) when a copy
# fails because retention removed the source meanwhile.
MAX_SOURCES = 3
PROBES = 3
PROBE_BYTES = 64 * 1024
# Hashing: one fixed buffer per file being hashed (at most files_in_flight of
# them: 8 MiB by default, beside the parts_in_flight × part_size of the
# uploads), and one thread hop per HASH_SPAN so a large file does not hold an
# executor thread for seconds.
HASH_BUFFER = 1024 * 1024
HASH_SPAN = 32 * 1024 * 1024


@dataclass(frozen=True)
class Candidate:
    """An object of an earlier checkpoint with the same path and size."""

    key: str
    sha256: str


def candidate_map(
    rows: list[tuple[str, int, int, int, str]], run: str, rank: int
) -> dict[tuple[str, int], Candidate]:
    """(path, size) → the object of the newest checkpoint holding a file of
    that path and size. ``rows``: (path, size, checkpoint_id, step, sha256),
    all of ``run`` and ``rank``."""
    found: dict[tuple[str, int], Candidate] = {}
    for path, size, _checkpoint_id, step, sha256 in sorted(rows, key=lambda r: -r[2]):
        found.setdefault((path, size), Candidate(layout.object_key(run, step, rank, path), sha256))
    return found


def probe_offsets(size: int) -> list[int]:
    """Where the probes read: the start (headers), the middle, the end."""
    length = min(PROBE_BYTES, size)
    return sorted({0, max(0, size // 2 - length // 2), size - length})


def _read_probes(source: SourceFile, roots: list[Path]) -> list[bytes]:
    length = min(PROBE_BYTES, source.size)
    fd = open_checked(source, roots)
    try:
        return [os.pread(fd, length, offset) for offset in probe_offsets(source.size)]
    finally:
        os.close(fd)


def _hash_span(
    fd: int, offset: int, length: int, buffer: memoryview, hasher: FileHashes, source: SourceFile
) -> None:
    end = offset + length
    while offset < end:
        got = os.preadv(fd, [buffer[: min(len(buffer), end - offset)]], offset)
        if not got:
            raise SourceChanged(f"{source.relative} was truncated after registration")
        hasher.update(buffer[:got])
        offset += got


async def hash_local(
    source: SourceFile, roots: list[Path], chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[str, tuple[str, ...] | None]:
    """SHA-256 of the registered local file and of its chunks (chunks.py: a
    copied file needs them as much as a sent one), refusing it
    (SourceChanged) if it is not what was registered, before or after the read."""
    fd = await asyncio.to_thread(open_checked, source, roots)
    try:
        hasher = FileHashes(chunk_size, source.size)
        buffer = memoryview(bytearray(min(HASH_BUFFER, max(source.size, 1))))
        for offset in range(0, source.size, HASH_SPAN):
            length = min(HASH_SPAN, source.size - offset)
            await asyncio.to_thread(_hash_span, fd, offset, length, buffer, hasher, source)
        await asyncio.to_thread(check_unchanged, fd, source)
    finally:
        os.close(fd)
    return hasher.finish()


class Deduplicator:
    """Decides, file by file of one shard, whether a copy can replace the upload.

    Built once per upload job (one catalog query for the candidates); called by
    ``pipeline.upload_file`` before it reads anything. Returns the uploaded
    file (``copied=True``) or None: send it.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        store: ObjectStore,
        checkpoint_id: int,
        candidates: dict[tuple[str, int], Candidate],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        self.chunk_size = chunk_size
        self.sessionmaker = sessionmaker
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.candidates = candidates

    @classmethod
    async def prepare(
        cls,
        sessionmaker: async_sessionmaker[AsyncSession],
        store: ObjectStore,
        *,
        checkpoint_id: int,
        run: str,
        rank: int,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> Deduplicator:
        try:
            candidates = await _recent_candidates(
                sessionmaker, store.region, checkpoint_id, run, rank
            )
        except Exception:
            # Without candidates, only client-given hashes are looked up.
            log.warning("dedup: reading earlier checkpoints failed", exc_info=True)
            candidates = {}
        return cls(sessionmaker, store, checkpoint_id, candidates, chunk_size)

    async def __call__(self, source: SourceFile, roots: list[Path]) -> UploadedFile | None:
        if source.size < MIN_DEDUP_BYTES:
            return None
        try:
            return await self._try(source, roots)
        except SourceChanged:
            raise  # the upload would fail the same way: the file is not what was registered
        except StoreError as exc:  # e.g. the earlier object was deleted since the query
            log.info("dedup of %s skipped: %s", source.relative, exc)
            return None
        except Exception:
            log.warning("dedup of %s failed; sending it instead", source.relative, exc_info=True)
            return None

    async def _try(self, source: SourceFile, roots: list[Path]) -> UploadedFile | None:
        if source.expected_sha256:
            keys = await self.lookup(source.expected_sha256, source.size)
            if not keys:
                return None
            digest, chunk_digests = await hash_local(source, roots, self.chunk_size)
            if digest != source.expected_sha256:
                raise SourceChanged(
                    f"{source.relative}: SHA-256 {digest} does not match the "
                    f"{source.expected_sha256} given at registration"
                )
        else:
            candidate = self.candidates.get((source.relative, source.size))
            if candidate is None or not await self._probes_match(source, roots, candidate.key):
                return None
            digest, chunk_digests = await hash_local(source, roots, self.chunk_size)
            keys = [candidate.key] if candidate.sha256 == digest else []
            keys += [k for k in await self.lookup(digest, source.size) if k not in keys]
            if not keys:
                # The probes matched but the content differs: this file pays a
                # second read (rare: a change confined between the probes).
                return None
        for key in keys[:MAX_SOURCES]:
            if await self._copy(key, source):
                return UploadedFile(
                    relative=source.relative,
                    size=source.size,
                    sha256=digest,
                    copied=True,
                    chunk_size=self.chunk_size if chunk_digests is not None else None,
                    chunk_sha256=chunk_digests,
                )
        return None

    async def lookup(self, sha256: str, size: int) -> list[str]:
        """Keys of objects with this content committed in the store's region,
        newest checkpoint first."""
        query = (
            select(Run.name, Checkpoint.step, Shard.rank, File.path)
            .select_from(File)
            .join(Shard, Shard.id == File.shard_id)
            .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .join(
                Replica,
                and_(Replica.checkpoint_id == Checkpoint.id, Replica.region == self.store.region),
            )
            .where(
                File.sha256 == sha256,
                File.size == size,
                Checkpoint.id != self.checkpoint_id,
                Checkpoint.state.in_(VALID_STATES),
                Replica.state == ReplicaState.COMMITTED,
            )
            .order_by(Checkpoint.id.desc())
            .limit(MAX_SOURCES)
        )
        async with reading(self.sessionmaker)() as session:
            rows = (await session.execute(query)).all()
        return [layout.object_key(run, step, rank, path) for run, step, rank, path in rows]

    async def _probes_match(self, source: SourceFile, roots: list[Path], key: str) -> bool:
        length = min(PROBE_BYTES, source.size)
        local, *remote = await asyncio.gather(
            asyncio.to_thread(_read_probes, source, roots),
            *(self.store.get_range(key, offset, length) for offset in probe_offsets(source.size)),
        )
        return bool(local == remote)

    async def _copy(self, source_key: str, source: SourceFile) -> bool:
        try:
            await self.store.copy_object(source_key, source.key, source.size)
            info = await self.store.head(source.key)
        except StoreError as exc:  # ObjectNotFound included: retention got there first
            log.info("dedup: copy of %s from %s failed: %s", source.relative, source_key, exc)
            return False
        if info is None or info.size != source.size:
            # Whatever is at the key is overwritten by the upload that follows.
            log.warning(
                "dedup: copy of %s from %s has %s bytes, expected %d",
                source.relative,
                source_key,
                None if info is None else info.size,
                source.size,
            )
            return False
        return True


async def _recent_candidates(
    sessionmaker: async_sessionmaker[AsyncSession],
    region: str,
    checkpoint_id: int,
    run: str,
    rank: int,
) -> dict[tuple[str, int], Candidate]:
    recent = (
        select(Checkpoint.id)
        .join(Run, Run.id == Checkpoint.run_id)
        .join(Replica, and_(Replica.checkpoint_id == Checkpoint.id, Replica.region == region))
        .where(
            Run.name == run,
            Checkpoint.id != checkpoint_id,
            Checkpoint.state.in_(VALID_STATES),
            Replica.state == ReplicaState.COMMITTED,
        )
        .order_by(Checkpoint.id.desc())
        .limit(RECENT_CHECKPOINTS)
    )
    query = (
        select(File.path, File.size, Checkpoint.id, Checkpoint.step, File.sha256)
        .select_from(File)
        .join(Shard, Shard.id == File.shard_id)
        .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
        .where(
            Checkpoint.id.in_(recent.scalar_subquery()),
            Shard.rank == rank,
            File.size >= MIN_DEDUP_BYTES,
            File.sha256.is_not(None),
        )
    )
    async with reading(sessionmaker)() as session:
        rows = [
            (path, size, cid, step, sha)
            for path, size, cid, step, sha in await session.execute(query)
            if sha is not None
        ]
    return candidate_map(rows, run, rank)
