"""Parallel ranged download of a set of files, SHA-256 verified on the fly.

Each file is split into fixed-size ranges fetched concurrently and written in
place with ``os.pwrite``. The hash is fed in file order from the ranges still
in memory (a bounded reorder window), so the data is never read back from
disk, and memory stays at ``window x range_size`` whatever the file sizes.

Where the time goes (py-spy and /proc CPU, SeaweedFS on 2 shared cores):
with httpx's defaults, receiving the bytes cost ~2.3-3 s of CPU per GB, 4x a
bare asyncio socket: httpcore asks for 64 KiB per read and anyio re-arms the
socket (two epoll_ctl calls and an event-loop round trip) for every read.
:func:`download_transport` asks for 1 MiB (anyio then returns a whole recv,
~230 KiB: 4x fewer reads, ~-25 % CPU), and answers httpcore's "is this idle
connection still open?" check before each request with one poll() instead of
rebuilding anyio's socket attributes. Range buffers are reused
(:class:`_Buffers`). What is left: SHA-256 (~1.1 s/GB, worker threads) and
httpx/h11 themselves, ~1 ms of CPU per request and ~2 s/GB, all in the one
event-loop thread. The same pipeline with aiohttp's GET in place of httpx's
measured 2.6 s/GB for the whole restore instead of 5.3.

So the clients' restores read presigned URLs with ``_direct_get`` (the body
received straight into the range buffer, ~1.2-1.9 s/GB for the whole
restore); httpx with :func:`download_transport` remains the path for the
service's own object endpoint, proxies, a transport the caller passed in,
and answers the direct reader does not handle.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import hashlib
import logging
import mmap
import os
import re
import select
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx

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


# Bytes asked of the socket per read; httpcore asks for 64 KiB. anyio hands
# back at most what one recv got (asyncio reads up to 256 KiB), so this only
# removes the split of bigger reads and the re-arm per 64 KiB.
READ_SIZE = 1 * MiB


def _socket_readable(sock: socket.socket | None) -> bool:
    """httpcore's test of an idle connection: readable means the server
    closed it (or sent junk), so it must not be reused."""
    fd = -1 if sock is None else sock.fileno()
    if fd < 0:
        return True
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class _BigReadStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self._inner = inner
        self._socket: socket.socket | None = None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max(max_bytes, READ_SIZE), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _BigReadStream(tls)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and hasattr(select, "poll"):
            # Asked of every idle connection before each request; anyio
            # answers by rebuilding all socket attributes (getpeername...).
            if self._socket is None:
                self._socket = self._inner.get_extra_info("socket")
            return _socket_readable(self._socket)
        return self._inner.get_extra_info(info)


class _BigReadBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, inner: httpcore.AsyncNetworkBackend):
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _BigReadStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_unix_socket(path, timeout, socket_options)
        return _BigReadStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@functools.cache
def ssl_context() -> ssl.SSLContext:
    # httpx builds one per client (~30 ms of CPU); downloads share this one,
    # made the way httpx makes its default (certifi, SSL_CERT_FILE/DIR).
    return httpx.create_ssl_context()


class _DownloadTransport(httpx.AsyncHTTPTransport):
    """httpx's transport (request/response mapping, errors, proxies from the
    client) over a connection pool that reads big chunks and keeps one
    connection per concurrent range."""

    def __init__(self, connections: int):
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        super().__init__(verify=ssl_context(), limits=limits)
        if isinstance(getattr(self, "_pool", None), httpcore.AsyncConnectionPool):
            self._pool = httpcore.AsyncConnectionPool(
                ssl_context=ssl_context(),
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry,
                network_backend=_BigReadBackend(httpcore.AnyIOBackend()),
            )
        # else: an httpx without that attribute keeps its own pool: slower, same bytes.


def download_transport(options: TransferOptions) -> httpx.AsyncBaseTransport:
    """The transport restore downloads use when the caller gave none."""
    return _DownloadTransport(options.concurrency)


Buffer = bytes | bytearray | memoryview


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A libc function (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_SYNC_FILE_RANGE = _libc(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
SYNC_FILE_RANGE_WRITE = 2
# fallocate(2), not posix_fallocate(3): where the filesystem cannot
# preallocate, glibc's posix_fallocate writes zeros over the whole file.
_FALLOCATE = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def preallocate(fd: int, size: int) -> bool:
    """Reserve the file's blocks up front, in one extent where the filesystem can.

    Ranges land out of order and are written back as they arrive
    (:func:`start_writeback`), so without this ext4 allocated blocks range by
    range at writeback, in the restoring process: after the benchmark's
    upload scenario had filled the disk's history, that cost 1.1 s of system
    CPU per GB and the restore fell to 0.99x boto3's (plain) download_file;
    preallocated, 0.4 s and 1.41x (5 interleaved repetitions). A full disk
    answers here, before a byte is downloaded (ENOSPC is raised); a
    filesystem that cannot preallocate is only slower (False)."""
    if _FALLOCATE is None or size <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(error, os.strerror(error))
    return False  # EOPNOTSUPP, ENOSYS, EINVAL...


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk
    now, without waiting and without dropping them from the page cache.

    A restore ends with an fsync of every file. Left alone, the kernel starts
    writing dirty pages only after ~30 s or once 10 % of memory is dirty, so
    a 1 GB restore wrote nothing until that fsync and then waited for the
    whole gigabyte (~3.5 s on this disk) after the last byte had arrived.
    Started per range, the writes overlap the download and the fsync finds
    little left. Only a hint: the fsync is still what makes the file durable,
    so a failure here is ignored (False)."""
    if _SYNC_FILE_RANGE is None or length <= 0:
        return False
    return _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0


def _write_range(fd: int, data: Buffer, offset: int) -> None:
    _pwrite_all(fd, data, offset)
    start_writeback(fd, offset, len(data))


# O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's
# logical block; a page covers every device this runs on.
ALIGNMENT = mmap.PAGESIZE
RangeBuffer = bytearray | mmap.mmap


def _write_unbuffered(fd: int, buffer: RangeBuffer, length: int, offset: int, size: int) -> None:
    """Write ``buffer[:length]`` at ``offset`` of a file opened with O_DIRECT.

    Every range but a file's last is a whole number of pages; the last is
    written padded to the next page (the buffer is a range long, a page
    multiple) and the file cut back to ``size``, its true length."""
    padded = -(-length // ALIGNMENT) * ALIGNMENT
    _pwrite_all(fd, memoryview(buffer)[:padded], offset)
    if padded != length:
        os.ftruncate(fd, size)


def _open_target(target: Path, unbuffered: bool = False) -> tuple[int, bool]:
    """The file's descriptor, and whether it bypasses the page cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    direct_flag = getattr(os, "O_DIRECT", 0)
    if unbuffered and direct_flag:
        try:
            return os.open(target, flags | direct_flag, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a filesystem without O_DIRECT
                raise
    return os.open(target, flags, 0o644), False


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.fd, self.unbuffered = _open_target(self.job.target, unbuffered=aligned)
        preallocate(self.fd, self.job.size)

    def write(self, buffer: RangeBuffer, start: int, end: int) -> None:
        """Write one range (in a worker thread)."""
        if self.unbuffered:
            _write_unbuffered(self.fd, buffer, end - start, start, self.job.size)
        else:
            _write_range(self.fd, memoryview(buffer)[: end - start], start)

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
        await in_thread(_fsync_close, fd)
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


class _Buffers:
    """Range buffers, reused: a fresh 8 MiB bytearray per range costs its
    zero-filling and ~2000 page faults, more CPU than copying the data in
    (py-spy: ~10 % of the restore's samples, ~3 % after). At most ``window``
    exist at once: the window semaphore bounds them. Anonymous mmaps, so
    they are page-aligned, as O_DIRECT writes need.

    Why O_DIRECT (where the filesystem has it): a buffered write copies every
    byte into page-cache pages, and on this VM fresh pages are slow to touch
    (perf: 64 % of a first restore's samples in copy_folio_from_iter_atomic,
    3 s of system CPU per GB). Written straight from these reused buffers,
    the first restore of a process went from 339 to 791 MB/s and one after
    boto3 had churned the page cache from 555 to 807 MB/s; system CPU
    0.35 s/GB. The fsync at the end still makes each file durable."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[RangeBuffer] = []

    def take(self) -> RangeBuffer:
        return self._free.pop() if self._free else mmap.mmap(-1, self.size)

    def give(self, buffer: RangeBuffer) -> None:
        self._free.append(buffer)


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
        check_range_response(job.url, job.size, start, end, response.status_code, response.headers)
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
    buffers = _Buffers(options.range_size)
    sinks: list[_Sink] = []

    def released(buffer: RangeBuffer) -> None:
        buffers.give(buffer)
        window.release()

    async def fetch(sink: _Sink, index: int) -> None:
        handed_over = False
        try:
            start, end = sink.bounds(index)
            buffer = buffers.take()
            async with network:
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
