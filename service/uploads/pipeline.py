"""Stream one file from local SSD to a region, hashing it in the same pass.

Each part is read (``preadv``) into one of a fixed pool of part buffers and
fed to SHA-256 in a worker thread (hashlib releases the GIL on large
buffers), strictly in order so one hash covers the file (and, in the same
pass, one hash per fixed-size chunk: ``storage/chunks.py``); the part is then
sent while the next one is read. The pool, shared by all files, bounds the
parts held in memory (``parts_in_flight × part_size``) whatever the
checkpoint's size, and its buffers are reused: no part is allocated, faulted
in or copied again on its way to the socket: a part is a view of its buffer,
and the store sends it as is (see ``storage/s3.py`` ``_PartBody``; a
``bytes`` body would be copied whole on the event loop by botocore and
aiohttp — measured at ~1.4 s of loop time per GB).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..storage.base import ObjectStore, PartRef
from ..storage.chunks import DEFAULT_CHUNK_SIZE, FileHashes
from .source import SourceChanged, SourceFile, check_unchanged, open_checked, read_into


class PartBuffers:
    """``count`` reusable buffers of ``size`` bytes, created on first use."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._count = count
        self._created = 0
        self._free: asyncio.Queue[bytearray] = asyncio.Queue()

    async def acquire(self) -> bytearray:
        if self._free.empty() and self._created < self._count:
            self._created += 1
            return bytearray(self.size)
        return await self._free.get()

    def release(self, buffer: bytearray) -> None:
        self._free.put_nowait(buffer)


@dataclass(frozen=True)
class UploadLimits:
    part_size: int
    parts: PartBuffers
    # The size of the chunks hashed one by one beside the whole file (chunks.py).
    chunk_size: int = DEFAULT_CHUNK_SIZE

    @classmethod
    def of(
        cls, part_size: int, parts_in_flight: int, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> UploadLimits:
        return cls(
            part_size=part_size,
            parts=PartBuffers(parts_in_flight, part_size),
            chunk_size=chunk_size,
        )


@dataclass(frozen=True)
class UploadedFile:
    relative: str
    size: int
    sha256: str
    # True when the bytes were not sent but copied server-side from an
    # identical object already in the region (see dedup.py).
    copied: bool = False
    # The SHA-256 of each chunk_size chunk, from the same read (chunks.py).
    chunk_size: int | None = None
    chunk_sha256: tuple[str, ...] | None = None


# Called before anything is read: a copy that replaces the upload, or None
# (send the file). Built per shard by the caller, see dedup.Deduplicator.
Dedup = Callable[[SourceFile, list[Path]], Awaitable[UploadedFile | None]]


def _read_and_hash(
    fd: int, offset: int, buffer: bytearray, length: int, source: SourceFile, hasher: FileHashes
) -> memoryview:
    """Fill ``buffer[:length]`` from the file, hash it; the part to send is a
    view of the buffer (the store sends it without copying, see s3._body)."""
    view = memoryview(buffer)[:length]
    read_into(fd, offset, view, source)
    hasher.update(view)
    return view


async def upload_file(
    store: ObjectStore,
    source: SourceFile,
    roots: list[Path],
    limits: UploadLimits,
    dedup: Dedup | None = None,
) -> UploadedFile:
    if dedup is not None:
        copied = await dedup(source, roots)
        if copied is not None:
            return copied
    fd = await asyncio.to_thread(open_checked, source, roots)
    try:
        hasher = FileHashes(limits.chunk_size)
        if source.size <= limits.part_size:
            buffer = await limits.parts.acquire()
            try:
                data = await asyncio.to_thread(
                    _read_and_hash, fd, 0, buffer, source.size, source, hasher
                )
                await store.put_bytes(source.key, data)
                del data
            finally:
                limits.parts.release(buffer)
        else:
            await _multipart(store, source, fd, hasher, limits)
        # The bytes sent must be the bytes registered: checked again after
        # the last read, on the same open file.
        await asyncio.to_thread(check_unchanged, fd, source)
    finally:
        os.close(fd)
    digest, chunk_digests = hasher.finish()
    if source.expected_sha256 and digest != source.expected_sha256:
        raise SourceChanged(
            f"{source.relative}: SHA-256 {digest} does not match the {source.expected_sha256} "
            "given at registration"
        )
    return UploadedFile(
        relative=source.relative,
        size=source.size,
        sha256=digest,
        chunk_size=limits.chunk_size if chunk_digests is not None else None,
        chunk_sha256=chunk_digests,
    )


async def _multipart(
    store: ObjectStore,
    source: SourceFile,
    fd: int,
    hasher: FileHashes,
    limits: UploadLimits,
) -> None:
    upload = await store.create_multipart(source.key)
    sends: list[asyncio.Task[PartRef]] = []

    async def send(number: int, offset: int, buffer: bytearray, data: memoryview) -> PartRef:
        try:
            return await store.upload_part(upload, number, offset, data)
        finally:
            limits.parts.release(buffer)

    try:
        for number, offset in enumerate(range(0, source.size, limits.part_size), start=1):
            buffer = await limits.parts.acquire()
            try:
                length = min(limits.part_size, source.size - offset)
                data = await asyncio.to_thread(
                    _read_and_hash, fd, offset, buffer, length, source, hasher
                )
            except BaseException:
                limits.parts.release(buffer)
                raise
            sends.append(asyncio.create_task(send(number, offset, buffer, data)))
            del data, buffer
            # Stop reading as soon as one part has failed.
            failed = next((t for t in sends if t.done() and t.exception()), None)
            if failed is not None:
                failed.result()
        parts = await asyncio.gather(*sends)
        await store.complete_multipart(upload, list(parts))
    except BaseException:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await store.abort_multipart(upload)
        raise
