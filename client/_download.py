"""Parallel ranged download of a set of files, SHA-256 verified on the fly.

Each file is split into fixed-size ranges fetched concurrently and written in
place (:mod:`._range_writes`). The hash is fed in file order from the ranges
still in memory (a bounded reorder window), so the data is never read back
from disk, and memory stays at ``window x range_size`` whatever the file
sizes. Hashing and file writes run in worker threads; the event-loop thread
only moves bytes.

Ranges are read through a :class:`RangeReader` where it accepts the URL
(``_direct_get``: presigned URLs, the body received straight into the range
buffer), else through the given httpx client (the service's own object
endpoint, proxies, a transport the caller passed in, answers the direct
reader does not handle).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from ._files import fsync_close
from ._range_writes import (
    ALIGNMENT,
    Buffer,
    RangeBuffer,
    RangeBuffers,
    open_target,
    preallocate,
    write_range,
    write_unbuffered,
)
from ._responses import detached

log = logging.getLogger("tierckpt.client.download")

T = TypeVar("T")

MiB = 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class TransferOptions:
    """Tunables of restore downloads."""

    range_size: int = 8 * MiB
    concurrency: int = 8
    # Ranges held in memory (in flight or waiting for their turn in the hash);
    # bounds memory to window * range_size.
    window: int = 16
    retries: int = 2
    retry_backoff: float = 0.2

    def __post_init__(self) -> None:
        if self.range_size < 1 or self.concurrency < 1 or self.retries < 0:
            raise ValueError("range_size and concurrency must be >= 1, retries >= 0")
        if self.window < self.concurrency:
            raise ValueError("window must be at least concurrency")


@dataclass(frozen=True)
class FileJob:
    url: str
    target: Path
    size: int
    sha256: str
    label: str
    headers: dict[str, str]


class SourceError(Exception):
    """The remote side failed (network, HTTP status, wrong bytes); another
    source may still succeed. Local I/O errors are deliberately not this."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``asyncio.to_thread`` that, when cancelled, still waits for the thread.

    A worker thread cannot be stopped; letting it run on after cancellation
    could pwrite stale bytes into a file a later attempt has re-created, or
    into a recycled file descriptor, after the hash was already checked.
    """
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        raise


def describe_url(url: str) -> str:
    # Presigned URLs carry credentials in the query; never put them in messages.
    parts = urlsplit(url)
    return f"{parts.netloc}{parts.path}" if parts.netloc else parts.path


class _Sink:
    """One file being written: collects ranges, hashes them in order, and
    verifies and fsyncs the file once the last one is in."""

    def __init__(self, job: FileJob, range_size: int, on_verified: Callable[[FileJob], None]):
        self.job = job
        self.fd = -1
        self.unbuffered = False
        self.range_size = range_size
        self.ranges = -(-job.size // range_size)
        self._on_verified = on_verified
        self._hasher = hashlib.sha256()
        self._next = 0
        self._pending: dict[int, tuple[Buffer, Callable[[], None]]] = {}
        self._lock = asyncio.Lock()
        self._finished = False

    def open(self) -> None:
        # Runs in a worker thread and records the descriptor itself, so it is
        # closed by close() even if the awaiting task was cancelled meanwhile.
        aligned = self.range_size % ALIGNMENT == 0
        self.fd, self.unbuffered = open_target(self.job.target, unbuffered=aligned)
        preallocate(self.fd, self.job.size)

    def write(self, buffer: RangeBuffer, start: int, end: int) -> None:
        """Write one range (in a worker thread)."""
        if self.unbuffered:
            write_unbuffered(self.fd, buffer, end - start, start, self.job.size)
        else:
            write_range(self.fd, memoryview(buffer)[: end - start], start)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.range_size
        return start, min(start + self.range_size, self.job.size)

    def put(self, index: int, data: Buffer, release: Callable[[], None]) -> None:
        self._pending[index] = (data, release)

    async def drain(self) -> None:
        """Hash whatever prefix of the file has arrived; finish after the last range."""
        async with self._lock:
            while self._next in self._pending:
                chunk, release = self._pending.pop(self._next)
                await in_thread(self._hasher.update, chunk)
                del chunk
                release()
                self._next += 1
            if self._next == self.ranges and not self._finished:
                await self.finish()

    async def finish(self) -> None:
        self._finished = True
        digest = self._hasher.hexdigest()
        if digest != self.job.sha256.lower():
            raise SourceError(
                f"SHA-256 mismatch for {self.job.label}: expected {self.job.sha256}, got {digest}"
            )
        fd, self.fd = self.fd, -1
        await in_thread(fsync_close, fd)
        self._on_verified(self.job)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


async def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    if response.is_stream_consumed:
        # A transport that answered with the body in memory (httpx.MockTransport).
        yield response.content
        return
    # Raw: no decoder or re-chunking layer per piece (identity, checked above).
    async for piece in response.aiter_raw():
        yield piece


def check_range_response(
    url: str, size: int, start: int, end: int, status: int, headers: Any
) -> None:
    """Raise :class:`SourceError` unless ``status`` and ``headers`` answer a
    GET of bytes ``start`` to ``end`` of a ``size``-byte object."""
    if status == 200 and (start, end) != (0, size):
        # Reading on would pull the whole object into memory for one range.
        raise SourceError(f"{describe_url(url)} ignored the Range header")
    if status not in (200, 206):
        retryable = status >= 500 or status == 429
        raise SourceError(f"{describe_url(url)} answered HTTP {status}", retryable=retryable)
    if status == 206:
        match = _CONTENT_RANGE.fullmatch(headers.get("content-range", "").strip())
        if match is None or (int(match[1]), int(match[2])) != (start, end - 1):
            raise SourceError(
                f"{describe_url(url)} answered the wrong range for bytes {start}-{end - 1}"
            )
        if match[3] != "*" and int(match[3]) != size:
            raise SourceError(f"{describe_url(url)} holds {match[3]} bytes, the plan says {size}")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Asked for identity; decoded bytes would not match the ranges.
        raise SourceError(f"{describe_url(url)} answered with Content-Encoding {encoding}")


async def _get_range(
    http: httpx.AsyncClient, job: FileJob, start: int, end: int, buffer: RangeBuffer
) -> None:
    """Fill ``buffer[: end - start]`` with bytes ``start`` to ``end`` of the object."""
    expected = end - start
    headers = {**job.headers, "Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    async with http.stream("GET", job.url, headers=headers) as response:
        try:
            check_range_response(
                job.url, job.size, start, end, response.status_code, response.headers
            )
            view = memoryview(buffer)[:expected]
            received = 0
            async for piece in _body(response):
                end_of_piece = received + len(piece)
                if end_of_piece > expected:
                    raise SourceError(
                        f"{describe_url(job.url)} sent more than the {expected} bytes asked for"
                    )
                view[received:end_of_piece] = piece
                received = end_of_piece
            view.release()
        finally:
            # Closed once the block ends: its stream then lets go of it, as
            # every API call's answer does (_responses.py), so a restore
            # leaves the caller's collector no cycle per range.
            await response.aclose()
            detached(response)
    if received != expected:
        raise SourceError(
            f"{describe_url(job.url)} ended after {received} of {expected} bytes", retryable=True
        )


class Unsupported(Exception):
    """A :class:`RangeReader` cannot fetch that URL or read that answer."""


class RangeReader(Protocol):
    """A faster path for ranged GETs than httpx (``_direct_get``); what it
    does not accept, or answers :class:`Unsupported` for, goes through httpx."""

    def accepts(self, url: str) -> bool: ...

    def refuse(self, url: str) -> None: ...

    async def get_into(
        self,
        url: str,
        headers: dict[str, str],
        size: int,
        start: int,
        end: int,
        buffer: RangeBuffer,
    ) -> None: ...


async def _get_range_retrying(
    http: httpx.AsyncClient,
    job: FileJob,
    start: int,
    end: int,
    options: TransferOptions,
    buffer: RangeBuffer,
    direct: RangeReader | None,
) -> None:
    attempt = 0
    while True:
        try:
            if direct is not None and direct.accepts(job.url):
                try:
                    return await direct.get_into(job.url, job.headers, job.size, start, end, buffer)
                except Unsupported as exc:
                    log.info("%s: %s; reading it through httpx", describe_url(job.url), exc)
                    direct.refuse(job.url)
            return await _get_range(http, job, start, end, buffer)
        except httpx.InvalidURL as exc:
            raise SourceError(f"bad URL for {job.label}: {exc}") from exc
        except httpx.RequestError as exc:
            error = SourceError(
                f"{describe_url(job.url)}: {type(exc).__name__} {exc}".rstrip(), retryable=True
            )
        except SourceError as exc:
            error = exc
        if not error.retryable or attempt >= options.retries:
            raise error
        await asyncio.sleep(options.retry_backoff * 2**attempt)
        attempt += 1


def _first_error(group: BaseExceptionGroup) -> BaseException:
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    # A local failure or a bug says more than the cancellations it caused.
    for exc in leaves:
        if not isinstance(exc, SourceError):
            return exc
    return leaves[0]


async def fetch_files(
    http: httpx.AsyncClient,
    jobs: list[FileJob],
    *,
    options: TransferOptions,
    on_bytes: Callable[[int], None] | None = None,
    on_verified: Callable[[FileJob], None] = lambda job: None,
    direct: RangeReader | None = None,
) -> None:
    """Download and verify every job, through ``direct`` where it accepts
    the URL. Raises :class:`SourceError` when the remote side failed,
    ``OSError`` when writing locally failed."""
    network = asyncio.Semaphore(options.concurrency)
    # Acquired in file/range order by the single producer below, so the
    # oldest unhashed range of every file always holds a slot: no deadlock.
    window = asyncio.Semaphore(options.window)
    buffers = RangeBuffers(options.range_size)
    sinks: list[_Sink] = []

    def released(buffer: RangeBuffer) -> None:
        buffers.give(buffer)
        window.release()

    async def fetch(sink: _Sink, index: int) -> None:
        handed_over = False
        try:
            start, end = sink.bounds(index)
            async with network:
                # Taken once the range can be fetched, not when it was queued:
                # only as many buffers as ranges in flight or awaiting their hash.
                buffer = buffers.take()
                await _get_range_retrying(http, sink.job, start, end, options, buffer, direct)
            await in_thread(sink.write, buffer, start, end)
            data = memoryview(buffer)[: end - start]
            if on_bytes is not None:
                on_bytes(end - start)

            # Once hashed, the buffer may take the next range.
            sink.put(index, data, functools.partial(released, buffer))
            handed_over = True
            # The sink owns the bytes now; holding them here while waiting for
            # the hash lock would let memory outgrow the window.
            del data, buffer
            await sink.drain()
        finally:
            if not handed_over:
                window.release()

    try:
        async with asyncio.TaskGroup() as group:
            for job in jobs:
                sink = _Sink(job, options.range_size, on_verified)
                sinks.append(sink)
                await in_thread(sink.open)
                if sink.ranges == 0:
                    await sink.finish()
                    continue
                for index in range(sink.ranges):
                    await window.acquire()
                    group.create_task(fetch(sink, index))
    except BaseExceptionGroup as group_error:
        raise _first_error(group_error) from None
    finally:
        for sink in sinks:
            sink.close()
        buffers.close()
