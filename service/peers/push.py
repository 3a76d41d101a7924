"""The ``peer_push`` job: one shard's T0 files to ``[peers] copies`` peers.

Bound to the shard's node (it reads that node's T0). Steps:

1. Every file the catalog has no SHA-256 for yet (the upload has not read
   it) is hashed from T0 and the hash recorded, as the upload would (the
   upload later checks that its own read agrees): a receiver verifies what
   arrives against the catalog, never against the pusher's word.
2. Targets: live agents (``agents.live_agents``) of another failure domain
   than this node's, not already holding a committed copy of the shard
   (copies on dead agents do not count: the shard needs new ones),
   spread over the candidates by a hash of (shard, node).
3. Each target gets every file (``PUT``, streamed in ``[peers] chunk_bytes``
   reads from a worker thread: bounded memory) and then the commit
   (``POST``), which records the copy committed. A target that fails is
   noted on its copy's row and the next candidate tried.

The job succeeds once the shard has its copies, or all the candidates it
could reach took one; with no candidate at all (every other agent down, or
all in this failure domain) it retries with the worker's backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

import httpx
from sqlalchemy import select, update

from ..db import reading, transaction
from ..jobs import queue
from ..jobs.worker import JobHandler, PermanentJobError
from ..models import (
    Checkpoint,
    File,
    Job,
    JobKind,
    PeerCopy,
    PeerCopyState,
    Shard,
)
from ..observability import metrics
from ..resources import Resources
from ..uploads.source import SourceChanged, SourceFile, open_checked
from . import agents
from .receive import upsert_copy
from .state import GONE, spread_key

log = logging.getLogger("tierckpt.peers")


class NoPeer(Exception):
    """No live agent of another failure domain can take a copy now."""


def _hash_fd(fd: int, chunk: int) -> str:
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


async def _read_chunks(handle: BinaryIO, chunk: int) -> AsyncIterator[bytes]:
    while block := await asyncio.to_thread(handle.read, chunk):
        yield block


class PeerPushJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self.settings = resources.settings
        self._http: httpx.AsyncClient | None = None

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.PEER_PUSH: JobHandler(run=self.push, on_failure=self.push_failed)}

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            token = self.settings.peers.token
            self._http = httpx.AsyncClient(
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=httpx.Timeout(60.0, connect=5.0),
            )
        return self._http

    async def push(self, job: Job) -> None:
        assert job.shard_id is not None
        wanted = self.settings.peers.copies
        async with transaction(self.r.sessionmaker) as session:
            checkpoint = await session.get(Checkpoint, job.checkpoint_id)
            shard = await session.get(Shard, job.shard_id)
            if (
                wanted <= 0
                or checkpoint is None
                or shard is None
                or checkpoint.state in GONE
                or shard.evicted_at is not None
            ):
                await queue.complete(session, job)
                return
            base = Path(shard.path)
            files = list(await session.scalars(select(File).where(File.shard_id == shard.id)))
            origin = shard.node
        await self._hash_unhashed(base, files)

        async with reading(self.r.sessionmaker)() as session:
            live = await agents.live_agents(session, self.settings.peers.lease_seconds)
            held = {
                node
                for node, state in await session.execute(
                    select(PeerCopy.node, PeerCopy.state).where(PeerCopy.shard_id == job.shard_id)
                )
                # A dead agent's copy cannot be read: it does not count.
                if state == PeerCopyState.COMMITTED and node != origin and node in live
            }
        domain = self.settings.server.domain
        candidates = sorted(
            (
                a
                for a in live.values()
                if a.node != origin and a.failure_domain != domain and a.node not in held
            ),
            key=lambda a: spread_key(job.shard_id or 0, a.node),
        )
        errors = []
        pushed = 0
        for agent in candidates:
            if len(held) + pushed >= wanted:
                break
            try:
                await self._push_to(agent, job, files, base)
                pushed += 1
            except (httpx.HTTPError, OSError, PushRefused) as exc:
                errors.append(f"{agent.node}: {exc}")
                log.warning("peer push of shard %s to %s failed: %s", job.shard_id, agent.node, exc)
                async with transaction(self.r.sessionmaker) as session:
                    await session.execute(
                        update(PeerCopy)
                        .where(
                            PeerCopy.shard_id == job.shard_id,
                            PeerCopy.node == agent.node,
                            PeerCopy.state == PeerCopyState.PENDING,
                        )
                        .values(error=str(exc)[:2000])
                    )
        if len(held) + pushed == 0:
            raise NoPeer(
                "no live agent of another failure domain took a copy"
                + (f": {'; '.join(errors)}" if errors else " (none is live)")
            )
        async with transaction(self.r.sessionmaker) as session:
            await queue.complete(session, job)

    async def _open(self, base: Path, f: File) -> int:
        """The registered file, as the upload opens it (upload/source.py):
        the memory tier's segment while it holds it, else T0 confined to the
        local roots, no symbolic link followed, size and mtime as registered."""
        source = SourceFile(
            path=base / f.path,
            relative=f.path,
            key="",
            size=f.size,
            mtime_ns=f.mtime_ns,
            elsewhere=partial(self.r.open_in_memory, base, f.path),
        )
        try:
            return await asyncio.to_thread(open_checked, source, self.settings.local.roots)
        except SourceChanged as exc:
            if not await asyncio.to_thread(os.path.lexists, source.path):
                # Being written to T0 from the memory tier: a later attempt finds it.
                raise NoPeer(f"{f.path} is not on T0 yet") from exc
            raise PermanentJobError(f"{exc}; not pushed") from exc

    async def _hash_unhashed(self, base: Path, files: list[File]) -> None:
        chunk = self.settings.peers.chunk_bytes
        for f in files:
            if f.sha256 is not None:
                continue
            fd = await self._open(base, f)
            digest = await asyncio.to_thread(_hash_fd, fd, chunk)
            if f.expected_sha256 and digest != f.expected_sha256:
                raise PermanentJobError(
                    f"{f.path}: SHA-256 {digest} differs from {f.expected_sha256} given at "
                    "registration; not pushed"
                )
            async with transaction(self.r.sessionmaker) as session:
                await session.execute(
                    update(File).where(File.id == f.id, File.sha256.is_(None)).values(sha256=digest)
                )
                known = await session.scalar(select(File.sha256).where(File.id == f.id))
            if known != digest:
                raise PermanentJobError(
                    f"{f.path}: SHA-256 {digest} differs from {known} read earlier; "
                    "the file changed after registration"
                )
            f.sha256 = digest

    async def _push_to(
        self, agent: agents.AgentInfo, job: Job, files: list[File], base: Path
    ) -> None:
        assert job.shard_id is not None
        async with transaction(self.r.sessionmaker) as session:
            await upsert_copy(
                session,
                shard_id=job.shard_id,
                checkpoint_id=job.checkpoint_id,
                node=agent.node,
                path="",
                state=PeerCopyState.PENDING,
            )
        http = self.http()
        chunk = self.settings.peers.chunk_bytes
        prefix = f"{agent.url}/v1/peers/shards/{job.shard_id}"
        for f in files:
            with os.fdopen(await self._open(base, f), "rb") as handle:
                response = await http.put(
                    f"{prefix}/files/{quote(f.path)}",
                    content=_read_chunks(handle, chunk),
                    headers={"Content-Length": str(f.size)},
                )
            _check(response)
            metrics.observe_peer_bytes("pushed", f.size)
        _check(await http.post(f"{prefix}/commit"))

    async def push_failed(self, session: object, job: Job, reason: str) -> None:
        log.error("peer push of shard %s gave up: %s", job.shard_id, reason)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


class PushRefused(Exception):
    """The peer answered a push with an error."""


def _check(response: httpx.Response) -> None:
    if response.status_code >= 300:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:500]
        raise PushRefused(f"HTTP {response.status_code}: {message}")
