"""Ranged GETs whose body the kernel copies straight into the range buffer.

Restore's bulk bytes do not need a general HTTP client: each request is a
GET of one byte range from a presigned URL, answered with a Content-Length
body that goes into a buffer we already hold. This module speaks exactly
that much HTTP/1.1 over an :class:`asyncio.BufferedProtocol`, whose
``get_buffer`` hands the kernel the unfilled tail of the range buffer: one
``recv_into`` per read, no intermediate ``bytes``, no per-read event-loop
round trip through anyio, httpcore and h11.

That removes most of the client CPU a restore spends per byte received
(the benchmark's restore scenario compares it with boto3's
``download_file``).

What it does not understand (chunked framing, a 2xx without
Content-Length, an URL it cannot send as is) raises :class:`Unsupported`;
the caller then uses httpx for that host. Proxies from the environment are
honoured by not taking proxied URLs at all.
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass
from typing import cast

import httpx

from ._api import USER_AGENT
from ._download import SourceError, Unsupported, check_range_response, describe_url
from ._download_transport import ssl_context
from ._range_writes import RangeBuffer

# A response head bigger than this is not an object store's answer.
MAX_HEAD = 64 * 1024
# Error bodies are read this far (for the connection's sake), then dropped.
MAX_ERROR_BODY = 64 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Closed(Exception):
    """The connection ended; ``received`` response bytes had arrived."""

    def __init__(self, received: int):
        super().__init__(f"connection closed after {received} bytes of the response")
        self.received = received


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    netloc: bytes
    path: bytes  # path and query, already percent-encoded


def _target(url: str) -> _Target:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise Unsupported(str(exc)) from exc
    if parsed.scheme not in _DEFAULT_PORTS or not parsed.host:
        raise Unsupported(f"not an absolute http(s) URL: {describe_url(url)}")
    path, netloc = parsed.raw_path, parsed.netloc
    # httpx percent-encodes what a request line cannot carry; refuse anything
    # that still could split or smuggle a line rather than trusting that.
    if any(b <= 0x20 or b >= 0x7F for b in path + netloc):
        raise Unsupported(f"URL not sendable as is: {describe_url(url)}")
    port = parsed.port or _DEFAULT_PORTS[parsed.scheme]
    return _Target(parsed.scheme, parsed.host, port, netloc, path)


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection running one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.progress = 0  # response bytes received, for the inactivity timeout
        self._scratch = bytearray(16 * 1024)
        self._head = bytearray()
        self._state = "idle"  # idle, head, body, discard
        self._body = memoryview(b"")
        self._received = 0
        self._expected = 0
        self._done: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True

    # -- protocol callbacks (event loop) ---------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's or uvloop's (which the sync client runs on): both call
        # get_buffer/buffer_updated, neither subclasses the other.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(_Closed(self.progress))

    def eof_received(self) -> bool:
        return False  # close our side too

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._state == "body":
            return self._body[self._received :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.progress += nbytes
        if self._state == "body":
            self._received += nbytes
            if self._received == self._expected:
                self._finish()
        elif self._state == "head":
            self._head += self._scratch[:nbytes]
            self._parse_head()
        elif self._state == "discard":
            self._received += nbytes
            if self._received >= self._expected:
                self.keep_alive = False
                self._finish()
        else:  # bytes nobody asked for: the connection is no longer in step
            self.keep_alive = False
            self._close()

    # -- request ----------------------------------------------------------------

    def start(self, request: bytes, body: memoryview) -> asyncio.Future[None]:
        assert self.transport is not None and self._state == "idle"
        self._body, self._expected, self._received = body, len(body), 0
        self._head.clear()
        self.progress = 0
        self.status, self.headers = 0, {}
        self._state = "head"
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._done

    def abandon(self) -> None:
        """The caller gave up (timeout, cancellation): never reuse this one.
        Bytes still arriving (a TLS transport delivers some while it shuts
        down) go to the scratch buffer, never into the caller's."""
        self._state = "idle"
        self._body = memoryview(b"")
        self.keep_alive = False
        self._close()

    # -- internals ------------------------------------------------------------

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n")
        if (end < 0 and len(self._head) > MAX_HEAD) or end > MAX_HEAD:
            self._fail(SourceError("response head too large", retryable=False))
            return
        if end < 0:
            return
        rest = bytes(self._head[end + 4 :])
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        self._head.clear()
        version, _, status = lines[0].partition(" ")
        code = status[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            self._fail(SourceError(f"not an HTTP/1.x answer: {lines[0][:80]!r}", retryable=True))
            return
        self.status = int(code)
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                self._fail(SourceError("malformed response header", retryable=True))
                return
            self.headers[name.strip().lower()] = value.strip()
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        if "transfer-encoding" in self.headers:
            self._fail(Unsupported("chunked response"))
            return
        length = self.headers.get("content-length", "")
        if not length.isdigit():
            if 200 <= self.status < 300:
                self._fail(Unsupported("response without Content-Length"))
                return
            # An error without a length: its body runs to the close; read none.
            self.keep_alive = False
            self._finish()
            return
        size = int(length)
        if 200 <= self.status < 300:
            if size != self._expected:
                self._fail(
                    SourceError(
                        f"answered {size} bytes for a range of {self._expected}",
                        retryable=False,
                    )
                )
                return
            self._state = "body"
        else:
            self._state, self._body = "discard", memoryview(b"")
            self._expected = min(size, MAX_ERROR_BODY)
            if size > MAX_ERROR_BODY:
                self.keep_alive = False
        self._received = 0
        self._take(rest)

    def _take(self, data: bytes) -> None:
        """Bytes that arrived with the head."""
        if self._state == "body":
            if len(data) > self._expected:
                self._fail(SourceError("sent more than the range asked for", retryable=False))
                return
            self._body[: len(data)] = data
        self._received = len(data)
        if self._received >= self._expected:
            if self._received > self._expected:
                self.keep_alive = False
            self._finish()

    def _finish(self) -> None:
        self._state = "idle"
        self._body = memoryview(b"")
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self._state = "idle"
        self._body = memoryview(b"")
        self.keep_alive = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class DirectRanges:
    """A keep-alive pool of :class:`_Connection` per host. Use as an async
    context manager; one per restore (its connections belong to one loop)."""

    def __init__(self, *, connect_timeout: float | None, read_timeout: float | None) -> None:
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._refused: set[tuple[str, str, int]] = set()
        self._proxies = urllib.request.getproxies_environment()
        self._unproxied: dict[tuple[str, str, int], bool] = {}
        # Parsed once per URL (None: not one this reader sends), not once
        # per range in accepts() and again in get_into().
        self._targets: dict[str, _Target | None] = {}

    async def __aenter__(self) -> DirectRanges:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.abandon()
        self._idle.clear()

    def accepts(self, url: str) -> bool:
        """An absolute http(s) URL, not behind a proxy, of a host that has
        not answered in a way this reader does not handle."""
        target = self._target_of(url)
        if target is None:
            return False
        key = self._key(target)
        if key in self._refused:
            return False
        direct = self._unproxied.get(key)
        if direct is None:
            # httpx (trust_env) would send it through a proxy: leave it to httpx.
            proxied = target.scheme in self._proxies or "all" in self._proxies
            direct = not proxied or bool(urllib.request.proxy_bypass(target.host))
            self._unproxied[key] = direct
        return direct

    def refuse(self, url: str) -> None:
        """Send this URL's host through httpx from now on."""
        target = self._target_of(url)
        if target is not None:
            self._refused.add(self._key(target))

    async def get_into(
        self,
        url: str,
        headers: dict[str, str],
        size: int,
        start: int,
        end: int,
        buffer: RangeBuffer,
    ) -> None:
        """Fill ``buffer[: end - start]`` with bytes ``start`` to ``end`` of
        the ``size``-byte object at ``url``. Raises :class:`SourceError` (the
        answer or the network failed) or :class:`Unsupported`."""
        target = self._target_of(url)
        if target is None:
            raise Unsupported(f"not a URL this reader sends: {describe_url(url)}")
        request = self._request(target, headers, start, end)
        body = memoryview(buffer)[: end - start]
        try:
            connection, reused = await self._connection(target)
            try:
                await self._exchange(connection, request, body)
            except _Closed as closed:
                if not (reused and closed.received == 0):
                    raise
                # The server dropped an idle connection as we sent: try a new one.
                connection, _ = await self._connection(target, fresh=True)
                await self._exchange(connection, request, body)
        except _Closed as closed:
            raise SourceError(
                f"{describe_url(url)} closed the connection after {closed.received} "
                f"bytes of a {end - start}-byte range",
                retryable=True,
            ) from None
        except OSError as exc:
            raise SourceError(
                f"{describe_url(url)}: {type(exc).__name__} {exc}".rstrip(), retryable=True
            ) from None
        except SourceError as exc:
            raise SourceError(f"{describe_url(url)}: {exc}", retryable=exc.retryable) from None
        try:
            check_range_response(url, size, start, end, connection.status, connection.headers)
        except SourceError:
            connection.abandon()  # a server answering wrongly gets a fresh start
            raise
        if connection.keep_alive and not connection.closed:
            self._idle.setdefault(self._key(target), []).append(connection)
        else:
            connection.abandon()

    # -- internals ---------------------------------------------------------------

    def _target_of(self, url: str) -> _Target | None:
        if url not in self._targets:
            try:
                self._targets[url] = _target(url)
            except Unsupported:
                self._targets[url] = None
        return self._targets[url]

    @staticmethod
    def _key(target: _Target) -> tuple[str, str, int]:
        return (target.scheme, target.host, target.port)

    @staticmethod
    def _request(target: _Target, headers: dict[str, str], start: int, end: int) -> bytes:
        lines = [
            b"GET " + target.path + b" HTTP/1.1",
            b"Host: " + target.netloc,
            b"Range: bytes=%d-%d" % (start, end - 1),
            b"Accept-Encoding: identity",
            b"User-Agent: " + USER_AGENT.encode(),
        ]
        for name, value in headers.items():
            line = f"{name}: {value}".encode("latin-1")
            if b"\r" in line or b"\n" in line:
                raise SourceError(f"header {name!r} holds a line break", retryable=False)
            lines.append(line)
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _connection(self, target: _Target, fresh: bool = False) -> tuple[_Connection, bool]:
        idle = self._idle.get(self._key(target), [])
        while idle and not fresh:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
        loop = asyncio.get_running_loop()
        tls = target.scheme == "https"
        opening = loop.create_connection(
            _Connection,
            target.host,
            target.port,
            ssl=ssl_context() if tls else None,
            server_hostname=target.host if tls else None,
        )
        try:
            _, connection = await asyncio.wait_for(opening, self._connect_timeout)
        except TimeoutError:
            raise SourceError(
                f"no connection to {target.host}:{target.port} within {self._connect_timeout} s",
                retryable=True,
            ) from None
        return connection, False

    async def _exchange(self, connection: _Connection, request: bytes, body: memoryview) -> None:
        done = connection.start(request, body)
        try:
            while True:
                seen = connection.progress
                finished, _ = await asyncio.wait({done}, timeout=self._read_timeout)
                if finished:
                    done.result()
                    return
                if connection.progress == seen:
                    raise SourceError(f"no bytes for {self._read_timeout} s", retryable=True)
        except BaseException:
            # Timed out, cancelled or failed mid-answer: the connection is out
            # of step (and may still write into ``body``) until it is closed.
            connection.abandon()
            if not done.done():
                done.cancel()
            raise
