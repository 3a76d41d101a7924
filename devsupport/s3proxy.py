"""A fault-injecting HTTP proxy in front of a real S3 server (SeaweedFS).

Requests pass through untouched until a test asks for trouble:

- ``fail(status=503, code="SlowDown", seconds=…, count=…)`` answers with an
  S3 XML error instead of forwarding (throttling, 500 InternalError, …),
  for a while or for the next N requests;
- ``delay(seconds, for_seconds=…)`` forwards, but only after a pause (a
  slow store);
- ``only=`` on either narrows the fault to the requests it accepts (say,
  one S3 operation that a bucket policy refuses), the rest pass;
- ``hold(only)`` stops the first request it accepts twice: on arrival,
  until the test lets it go on to the store, and once the store has
  answered, until the test releases the answer. The write has landed, its
  client does not know yet: the moment to kill that client.

Every request is logged (time, method, path, query, x-amz-* headers,
status, whether it was a fault), so a test can count attempts and see how they were spaced: retries
with backoff, not a busy loop. It listens on loopback only and runs its own
event loop in a thread (``loopthread.LoopbackServerThread``).
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .loopthread import LoopbackServerThread

__all__ = ["Fault", "Hold", "S3FaultProxy", "Seen"]

# Hop-by-hop and framing headers are the proxy's own business on each side.
_SKIP_REQUEST = {"host", "content-length", "transfer-encoding", "connection", "expect"}
_SKIP_RESPONSE = {"content-length", "transfer-encoding", "connection", "content-encoding"}
_REASONS = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclass(frozen=True)
class Seen:
    at: float  # time.monotonic()
    method: str
    path: str
    status: int
    fault: bool
    query: str = ""  # the raw query string (?uploads, ?partNumber=…)
    # The request's x-amz-* headers, names lower-cased (encryption, storage class, …).
    amz: tuple[tuple[str, str], ...] = ()


@dataclass
class Fault:
    status: int = 0
    code: str = ""
    delay: float = 0.0
    until: float | None = None  # monotonic deadline
    remaining: int | None = None  # requests left
    only: Callable[[web.Request], bool] | None = None  # the requests it hits

    def active(self, now: float) -> bool:
        if self.until is not None and now >= self.until:
            return False
        return self.remaining is None or self.remaining > 0


# The longest a held request or answer waits for the test.
HOLD_SECONDS = 120


@dataclass
class Hold:
    """One request stopped by ``S3FaultProxy.hold`` (events, from any thread)."""

    only: Callable[[web.Request], bool]
    arrived: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)  # set by the test: forward
    landed: threading.Event = field(default_factory=threading.Event)  # the store answered
    release: threading.Event = field(default_factory=threading.Event)  # set by the test
    taken: bool = False


class S3FaultProxy(LoopbackServerThread):
    def __init__(self, target_url: str, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self.target = target_url.rstrip("/")
        self.log: list[Seen] = []
        self._fault: Fault | None = None
        self._hold: Hold | None = None
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- control (from any thread) -------------------------------------------

    def fail(
        self,
        status: int = 503,
        code: str = "SlowDown",
        *,
        seconds: float | None = None,
        count: int | None = None,
        only: Callable[[web.Request], bool] | None = None,
    ) -> None:
        """Answer ``status`` with an S3 error ``code`` instead of forwarding,
        for ``seconds`` or for the next ``count`` requests (or until clear()),
        to every request or to those ``only`` accepts."""
        with self._lock:
            self._fault = Fault(
                status=status,
                code=code,
                until=None if seconds is None else time.monotonic() + seconds,
                remaining=count,
                only=only,
            )

    def delay(self, seconds: float, *, for_seconds: float | None = None) -> None:
        """Forward every request only after ``seconds`` (a slow store)."""
        with self._lock:
            self._fault = Fault(
                delay=seconds,
                until=None if for_seconds is None else time.monotonic() + for_seconds,
            )

    def hold(self, only: Callable[[web.Request], bool]) -> Hold:
        """Stop the next request ``only`` accepts before the store, until
        ``go``, and its answer after the store, until ``release``."""
        hold = Hold(only)
        with self._lock:
            self._hold = hold
        return hold

    def clear(self) -> None:
        with self._lock:
            self._fault = None

    def faults(self) -> list[Seen]:
        return [seen for seen in list(self.log) if seen.fault]

    # -- internals (in the proxy's loop) ---------------------------------------

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300),
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _take_fault(self, request: web.Request) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is None or not fault.active(time.monotonic()):
                return None
            if fault.only is not None and not fault.only(request):
                return None
            if fault.remaining is not None:
                fault.remaining -= 1
            return fault

    def _record(self, request: web.Request, status: int, *, fault: bool) -> None:
        amz = tuple(
            sorted(
                (k.lower(), v) for k, v in request.headers.items() if k.lower().startswith("x-amz-")
            )
        )
        self.log.append(
            Seen(
                time.monotonic(),
                request.method,
                request.path,
                status,
                fault,
                query=request.query_string,
                amz=amz,
            )
        )

    def _take_hold(self, request: web.Request) -> Hold | None:
        with self._lock:
            hold = self._hold
            if hold is None or hold.taken or not hold.only(request):
                return None
            hold.taken = True
            return hold

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        held = self._take_hold(request)
        if held is not None:
            held.arrived.set()
            await asyncio.to_thread(held.go.wait, HOLD_SECONDS)
        fault = self._take_fault(request)
        if fault is not None and fault.status:
            self._record(request, fault.status, fault=True)
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{fault.code}</Code>"
                f"<Message>{_REASONS.get(fault.code, fault.code)}</Message>"
                f"<Resource>{request.path}</Resource><RequestId>fault-proxy</RequestId></Error>"
            )
            return web.Response(status=fault.status, text=xml, content_type="application/xml")
        if fault is not None and fault.delay:
            await asyncio.sleep(fault.delay)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST}
        headers["Host"] = request.headers.get("Host", "")
        async with self._session.request(
            request.method,
            self.target + request.rel_url.raw_path_qs,
            headers=headers,
            # A file-like body: aiohttp warns (an error under pytest) on big bytes.
            data=io.BytesIO(body) if body else None,
            allow_redirects=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
        ) as upstream:
            if held is not None:
                await upstream.read()
                held.landed.set()
                await asyncio.to_thread(held.release.wait, HOLD_SECONDS)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _SKIP_RESPONSE:
                    response.headers.add(name, value)
            if upstream.headers.get("Content-Length") is not None:
                response.content_length = int(upstream.headers["Content-Length"])
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(1 << 16):
                await response.write(chunk)
            await response.write_eof()
        self._record(request, upstream.status, fault=False)
        return response
