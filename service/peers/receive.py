"""Receiving a peer copy: files hashed on arrival, then the shard committed.

A push is one ``PUT`` per file and a ``POST .../commit`` per shard. Each file
streams into ``<partial dir>/<path>.tmp`` through a buffer of ``[peers]
chunk_bytes`` (bounded memory whatever the file's size), hashed as it is
written, and is kept only if its size and SHA-256 equal the catalog's: a
short, long or corrupt push is answered 4xx and leaves nothing behind. The
catalog's hash is the reference, not anything the pusher says: a peer token
can only place bytes the catalog already vouches for. The commit checks
that every file of the shard arrived, gives each its registered mtime (an
upload from this copy, after a takeover, checks it), fsyncs, renames the
partial directory into place and records the copy committed.

A shard of a checkpoint deleted (or failed) is refused, 409
``checkpoint_gone``, at each file and again at the commit, in the
transaction that would record it; what arrived of it is discarded. A
deletion that commits after that transaction leaves a committed copy of a
deleted checkpoint: the node's next peer pass evicts it (upkeep.py).

Crash safety: a kill at any moment leaves either no committed row (the
pusher pushes again; the partial directory is replaced) or a directory
renamed into place, fsynced, before the row says committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from ...client._files import fsync_dir
from ..db import dialect_name, reading, transaction
from ..errors import ApiError, BadInput, Conflict, NotFound
from ..models import (
    Checkpoint,
    CheckpointState,
    File,
    PeerCopy,
    PeerCopyState,
    Run,
    Shard,
    utcnow,
)
from ..observability import metrics
from ..resources import Resources
from . import layout
from .state import GONE


@dataclass(frozen=True)
class ShardInfo:
    shard_id: int
    checkpoint_id: int
    run: str
    step: int
    rank: int
    node: str
    checkpoint_state: str
    # relative path -> (size, sha256 or None, mtime_ns)
    files: dict[str, tuple[int, str | None, int]]


async def shard_info(session: AsyncSession, shard_id: int) -> ShardInfo:
    row = (
        await session.execute(
            select(
                Shard.checkpoint_id,
                Shard.rank,
                Shard.node,
                Checkpoint.step,
                Checkpoint.state,
                Run.name,
            )
            .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Shard.id == shard_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"shard {shard_id} is not in the catalog", code="shard_not_found")
    checkpoint_id, rank, node, step, state, run = row
    files = {
        path: (size, sha256, mtime_ns)
        for path, size, sha256, mtime_ns in await session.execute(
            select(File.path, File.size, File.sha256, File.mtime_ns).where(
                File.shard_id == shard_id
            )
        )
    }
    return ShardInfo(shard_id, checkpoint_id, run, step, rank, node, state, files)


async def load_shard(resources: Resources, shard_id: int) -> ShardInfo:
    async with reading(resources.read_sessionmaker or resources.sessionmaker)() as session:
        return await shard_info(session, shard_id)


def _final_dir(resources: Resources, info: ShardInfo) -> Path:
    return layout.copy_dir(resources.settings.local.roots, info.run, info.step, info.rank)


class _Sink:
    """One file being received: written and hashed off the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray) -> None:
        self.handle.write(data)
        self.sha.update(data)
        self.size += len(data)

    def close(self, keep: bool) -> None:
        try:
            if keep:
                self.handle.flush()
                os.fsync(self.handle.fileno())
        finally:
            self.handle.close()
            if not keep:
                self.path.unlink(missing_ok=True)


async def receive_file(
    resources: Resources, shard_id: int, relative: str, body: AsyncIterator[bytes]
) -> int:
    """Store one pushed file of ``shard_id``; the bytes received."""
    info = await load_shard(resources, shard_id)
    if info.node == resources.settings.server.node:
        raise Conflict("a shard is not pushed to its own node", code="own_shard")
    await _refuse_if_gone(resources, info, info.checkpoint_state)
    expected = info.files.get(relative)
    if expected is None:
        raise NotFound(
            f"shard {shard_id} has no file {relative[:200]!r} in the catalog", code="file_not_found"
        )
    size, sha256, _mtime = expected
    if sha256 is None:
        raise Conflict(
            f"{relative}: the catalog has no SHA-256 for it yet; push after hashing",
            code="hash_unknown",
        )
    staging = layout.partial_dir(_final_dir(resources, info))
    target = layout.confined(staging, relative)
    temporary = target.with_name(target.name + ".tmp")
    sink = await asyncio.to_thread(_Sink, temporary)
    limit = resources.settings.peers.chunk_bytes
    buffer = bytearray()
    kept = False
    try:
        async for piece in body:
            buffer += piece
            if sink.size + len(buffer) > size:
                raise ApiError(
                    f"{relative}: more than the {size} bytes the catalog records",
                    code="too_long",
                    status=422,
                )
            if len(buffer) >= limit:
                # Handed over whole (no copy); a new buffer takes what follows.
                full, buffer = buffer, bytearray()
                await asyncio.to_thread(sink.write, full)
        if buffer:
            await asyncio.to_thread(sink.write, buffer)
        if sink.size != size:
            raise ApiError(
                f"{relative}: {sink.size} bytes received, the catalog records {size}",
                code="short_push",
                status=422,
            )
        digest = sink.sha.hexdigest()
        if digest != sha256:
            metrics.observe_peer_corrupt("push")
            raise ApiError(
                f"{relative}: SHA-256 {digest} of the bytes received differs from the "
                f"catalog's {sha256}",
                code="sha256_mismatch",
                status=422,
            )
        kept = True
    finally:
        await asyncio.to_thread(sink.close, kept)
    await asyncio.to_thread(os.replace, temporary, target)
    metrics.observe_peer_bytes("received", size)
    return size


def _finish(staging: Path, final: Path, files: dict[str, tuple[int, str | None, int]]) -> None:
    for relative, (size, _sha, mtime_ns) in files.items():
        path = layout.confined(staging, relative)
        try:
            found = path.stat().st_size
        except FileNotFoundError as exc:
            raise BadInput(
                f"{relative} was not pushed before the commit", code="incomplete"
            ) from exc
        if found != size:
            raise BadInput(f"{relative} holds {found} bytes, not {size}", code="incomplete")
        os.utime(path, ns=(mtime_ns, mtime_ns))
    for directory in {layout.confined(staging, r).parent for r in files} | {staging}:
        fsync_dir(directory)
    if final.exists():
        # An earlier copy (corrupt, evicted, or interrupted mid-commit): replaced whole.
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_dir(final.parent)


async def commit_copy(resources: Resources, shard_id: int) -> Path:
    info = await load_shard(resources, shard_id)
    await _refuse_if_gone(resources, info, info.checkpoint_state)
    final = _final_dir(resources, info)
    staging = layout.partial_dir(final)
    await asyncio.to_thread(_finish, staging, final, info.files)
    node = resources.settings.server.node
    now = utcnow()
    gone: str | None = None
    async with transaction(resources.sessionmaker) as session:
        state = await session.scalar(
            select(Checkpoint.state).where(Checkpoint.id == info.checkpoint_id)
        )
        if state is None or state in GONE:
            gone = state or CheckpointState.DELETED  # deleted since the check above
        else:
            await upsert_copy(
                session,
                shard_id=shard_id,
                checkpoint_id=info.checkpoint_id,
                node=node,
                path=str(final),
                state=PeerCopyState.COMMITTED,
                committed_at=now,
                verified_at=now,
            )
    if gone is not None:
        # Not recorded: the copy renamed into place goes too (after the
        # transaction: no catalog lock is held across disk work).
        await asyncio.to_thread(shutil.rmtree, final, True)
        await _refuse_if_gone(resources, info, gone)
    return final


async def upsert_copy(
    session: AsyncSession,
    *,
    shard_id: int,
    checkpoint_id: int,
    node: str,
    path: str,
    state: str,
    committed_at: object = None,
    verified_at: object = None,
    error: str | None = None,
) -> None:
    dialect = postgresql if dialect_name(session) == "postgresql" else sqlite
    values = {
        "shard_id": shard_id,
        "checkpoint_id": checkpoint_id,
        "node": node,
        "path": path,
        "state": state,
        "committed_at": committed_at,
        "verified_at": verified_at,
        "error": error,
        "created_at": utcnow(),
    }
    statement = dialect.insert(PeerCopy).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=["shard_id", "node"],
        set_={k: v for k, v in values.items() if k not in ("shard_id", "node", "created_at")},
    )
    await session.execute(statement)


async def _refuse_if_gone(resources: Resources, info: ShardInfo, state: str) -> None:
    """409 for a shard of a deleted or failed checkpoint; what arrived of
    it is discarded first."""
    if state not in GONE:
        return
    await asyncio.to_thread(discard_partial, resources, info)
    raise Conflict(
        f"checkpoint {info.run}:{info.step} is {state}: no peer copy of it is kept; "
        "the files sent were discarded",
        code="checkpoint_gone",
    )


def discard_partial(resources: Resources, info: ShardInfo) -> None:
    shutil.rmtree(layout.partial_dir(_final_dir(resources, info)), ignore_errors=True)
