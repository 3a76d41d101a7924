"""Stream one file from local SSD to one or more regions, hashing it in the same pass.

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

Several regions (a fan-out upload) share the read: each part goes to every
region before its buffer is reused, so a second region costs its sends, not
a second read and hash of the file. A secondary region that fails is
dropped for the rest of the file; only the first region's failure fails the
upload (``upload_file_to``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..observability import metrics
from ..storage.base import MultipartUpload, ObjectStore, PartRef
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


@dataclass(frozen=True)
class Destination:
    """A region one file goes to, and its dedup (None: always send)."""

    store: ObjectStore
    dedup: Dedup | None = None


# What became of one file in one destination: uploaded, or why not.
Outcome = UploadedFile | Exception


def _read_and_hash(
    fd: int, offset: int, buffer: bytearray, length: int, source: SourceFile, hasher: FileHashes
) -> memoryview:
    """Fill ``buffer[:length]`` from the file, hash it; the part to send is a
    view of the buffer (the store sends it without copying, see s3._body)."""
    view = memoryview(buffer)[:length]
    read_into(fd, offset, view, source)
    hasher.update(view)
    return view


async def _read_part(
    fd: int, offset: int, buffer: bytearray, length: int, source: SourceFile, hasher: FileHashes
) -> memoryview:
    """``_read_and_hash`` in a thread that, if the caller is cancelled, is
    still waited for: it writes into a buffer that then goes back to the
    pool, and must not write into it once another part holds it."""
    future = asyncio.ensure_future(
        asyncio.to_thread(_read_and_hash, fd, offset, buffer, length, source, hasher)
    )
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        raise


async def upload_file(
    store: ObjectStore,
    source: SourceFile,
    roots: list[Path],
    limits: UploadLimits,
    dedup: Dedup | None = None,
) -> UploadedFile:
    """Send one file to one region."""
    (outcome,) = await upload_file_to([Destination(store, dedup)], source, roots, limits)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


async def upload_file_to(
    destinations: list[Destination],
    source: SourceFile,
    roots: list[Path],
    limits: UploadLimits,
) -> list[Outcome]:
    """Send one file to every destination from one read and one hash pass:
    each part, once read and hashed, goes to all of them before its buffer
    is reused.

    The first destination is the caller's own: its failure raises. Another
    one that fails is dropped for the rest of the file (its multipart upload
    aborted) and its exception returned in its place: a broken secondary
    region never fails the primary's upload."""
    outcomes: list[Outcome | None] = [None] * len(destinations)
    sending: list[int] = []
    for index, destination in enumerate(destinations):
        try:
            copied = None if destination.dedup is None else await destination.dedup(source, roots)
        except Exception as exc:
            if index == 0:
                raise
            outcomes[index] = exc
            continue
        if copied is not None:
            outcomes[index] = copied
        else:
            sending.append(index)
    if not sending:
        return [o for o in outcomes if o is not None]
    stores = {index: destinations[index].store for index in sending}
    fd = await asyncio.to_thread(open_checked, source, roots)
    try:
        hasher = FileHashes(limits.chunk_size, source.size)
        if source.size <= limits.part_size:
            failed = await _single_put(stores, source, fd, hasher, limits)
        else:
            failed = await _multipart(stores, source, fd, hasher, limits)
        # The bytes sent must be the bytes registered: checked again after
        # the last read, on the same open file.
        await asyncio.to_thread(check_unchanged, fd, source)
    finally:
        os.close(fd)
    metrics.observe_upload_read(source.size)
    digest, chunk_digests = hasher.finish()
    if source.expected_sha256 and digest != source.expected_sha256:
        raise SourceChanged(
            f"{source.relative}: SHA-256 {digest} does not match the {source.expected_sha256} "
            "given at registration"
        )
    uploaded = UploadedFile(
        relative=source.relative,
        size=source.size,
        sha256=digest,
        chunk_size=limits.chunk_size if chunk_digests is not None else None,
        chunk_sha256=chunk_digests,
    )
    for index in sending:
        outcomes[index] = failed.get(index, uploaded)
    return [o for o in outcomes if o is not None]


def _keep_going(failures: dict[int, Exception], index: int, exc: Exception) -> None:
    """Record a destination's failure; the first destination's is raised."""
    if index == 0:
        raise exc
    failures.setdefault(index, exc)


async def _single_put(
    stores: dict[int, ObjectStore],
    source: SourceFile,
    fd: int,
    hasher: FileHashes,
    limits: UploadLimits,
) -> dict[int, Exception]:
    buffer = await limits.parts.acquire()
    failures: dict[int, Exception] = {}
    try:
        data = await _read_part(fd, 0, buffer, source.size, source, hasher)
        indexes = list(stores)
        results = await asyncio.gather(
            *(stores[i].put_bytes(source.key, data) for i in indexes), return_exceptions=True
        )
        del data
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                _keep_going(failures, index, result)
    finally:
        limits.parts.release(buffer)
    return failures


async def _multipart(
    stores: dict[int, ObjectStore],
    source: SourceFile,
    fd: int,
    hasher: FileHashes,
    limits: UploadLimits,
) -> dict[int, Exception]:
    failures: dict[int, Exception] = {}
    uploads: dict[int, MultipartUpload] = {}
    started = await asyncio.gather(
        *(stores[i].create_multipart(source.key) for i in stores), return_exceptions=True
    )
    for index, result in zip(list(stores), started, strict=True):
        if isinstance(result, MultipartUpload):
            uploads[index] = result
        elif isinstance(result, Exception):
            failures[index] = result
        else:
            raise result
    if 0 in failures:
        await _abort(stores, uploads)
        raise failures[0]
    parts: dict[int, list[PartRef]] = {index: [] for index in uploads}
    sends: list[asyncio.Task[None]] = []
    # Part number -> its buffer, until every send of the part has ended. A
    # send cancelled before it started never runs its finally: its buffer is
    # given back from here, or the pool would shrink for good.
    holding: dict[int, bytearray] = {}

    async def send_one(index: int, number: int, offset: int, data: memoryview) -> None:
        try:
            parts[index].append(
                await stores[index].upload_part(uploads[index], number, offset, data)
            )
        except Exception as exc:
            _keep_going(failures, index, exc)

    async def send(number: int, offset: int, data: memoryview) -> None:
        live = [i for i in uploads if i not in failures]
        try:
            # Every send of the part has ended before its buffer is reused.
            results = await asyncio.gather(
                *(send_one(i, number, offset, data) for i in live), return_exceptions=True
            )
        finally:
            limits.parts.release(holding.pop(number))
        for result in results:
            if isinstance(result, BaseException):
                raise result

    try:
        for number, offset in enumerate(range(0, source.size, limits.part_size), start=1):
            buffer = await limits.parts.acquire()
            try:
                length = min(limits.part_size, source.size - offset)
                data = await _read_part(fd, offset, buffer, length, source, hasher)
            except BaseException:
                limits.parts.release(buffer)
                raise
            holding[number] = buffer
            sends.append(asyncio.create_task(send(number, offset, data)))
            del data, buffer
            # Stop reading as soon as the first destination has failed.
            failed = next((t for t in sends if t.done() and t.exception()), None)
            if failed is not None:
                failed.result()
        await asyncio.gather(*sends)
        live = [i for i in uploads if i not in failures]
        await _abort(stores, {i: u for i, u in uploads.items() if i in failures})
        completed = await asyncio.gather(
            *(
                stores[i].complete_multipart(uploads[i], sorted(parts[i], key=lambda p: p.number))
                for i in live
            ),
            return_exceptions=True,
        )
        for index, outcome in zip(live, completed, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                _keep_going(failures, index, outcome)
    except BaseException:
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        for buffer in holding.values():
            limits.parts.release(buffer)
        holding.clear()
        await _abort(stores, uploads)
        raise
    return failures


async def _abort(stores: dict[int, ObjectStore], uploads: dict[int, MultipartUpload]) -> None:
    await asyncio.gather(*(stores[i].abort_multipart(u) for i, u in uploads.items()))
