"""The httpx transport restore downloads use when the caller gave none.

With httpx's defaults, receiving the bytes costs several times the CPU of a
bare asyncio socket: httpcore asks for 64 KiB per read and anyio re-arms the
socket (two epoll_ctl calls and an event-loop round trip) for every read.
This transport asks for 1 MiB per read (anyio then returns a whole recv),
answers httpcore's "is this idle connection still open?" check before each
request with one poll() instead of rebuilding anyio's socket attributes,
and keeps one connection per concurrent range. Presigned URLs are mostly
read by ``_direct_get`` instead; this path serves the service's own object
endpoint, proxies, and what the direct reader does not handle.
"""

from __future__ import annotations

import functools
import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from ._download import MiB, TransferOptions

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
