"""Request limits as pure ASGI middleware: body size (enforced while the body
streams in) and a per-caller request rate (token bucket)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import TokenSettings
from .errors import error_body
from .plain_asgi import send_json

# A peer copy's file is as large as the checkpoint's: its receiver bounds it
# by the size the catalog records instead (peers/receive.py).
PEER_PUSH_PREFIX = "/v1/peers/shards/"


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            scope.get("method") == "PUT" and scope.get("path", "").startswith(PEER_PUSH_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self._reject(send)
                return
            if b"transfer-encoding" not in headers:
                # The HTTP server delivers no more than the declared length:
                # nothing to count (and no wrapper on every message).
                await self.app(scope, receive, send)
                return
        seen = 0
        started = False
        rejected = False

        # A body without Content-Length (chunked) is counted as it arrives.
        # Past the limit the 413 is sent from here and the application sees
        # a disconnect; whatever it answers to that is dropped (raising into
        # it instead would come back as its own "cannot parse the body" 400).
        async def limited_receive() -> Message:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not started:
                    rejected = True
                    await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            if not rejected:
                raise

    async def _reject(self, send: Send) -> None:
        await send_json_error(
            send, 413, "body_too_large", f"request body exceeds {self.max_bytes} bytes"
        )


# Probes must answer even for a caller that is being throttled, and the POSIX
# object route carries the bytes of a restore (one request per ranged read,
# no catalog work): its pace is the client's parallelism, not a request rate.
# So do the peer copies' routes: a push is one request per file, a restore
# from a peer one per ranged read.
UNLIMITED_PREFIXES = ("/healthz", "/readyz", "/metrics", "/v1/regions/", "/v1/peers/")


async def send_json_error(
    send: Send,
    status: int,
    code: str,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer with the service's JSON error shape from plain ASGI."""
    payload = json.dumps(error_body(code, message)).encode()
    await send_json(send, status, payload, headers)


class TokenBuckets:
    """Token buckets by key, in memory (one agent process).

    The set of keys is bounded: configured tokens, plus one per client
    address; past ``max_keys`` the least recently seen bucket is dropped
    (a dropped bucket comes back full, which only errs on the lenient side).
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Take one token: 0.0 when allowed, else seconds until one is available."""
        now = self._clock()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


class RateLimit:
    """At most ``rate`` requests per second (bursts of ``burst``) per caller.

    The caller is the configured token presented (matched by its SHA-256 in
    constant time, as auth does), else the client address: unauthenticated
    or wrong-token requests, and everyone when no tokens are configured (the
    loopback admin), are limited per address. Over the limit: 429 with
    ``Retry-After`` and the usual JSON error body.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        rate: float,
        burst: int,
        tokens: list[TokenSettings],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.buckets = TokenBuckets(rate, burst, clock=clock) if rate > 0 else None
        self._digests = [t.sha256 for t in tokens]

    def caller(self, scope: Scope) -> str:
        authorization = None
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        if self._digests and authorization and authorization[:7].lower() == "bearer ":
            presented = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
            match = None
            for digest in self._digests:
                if hmac.compare_digest(presented, digest):
                    match = digest
            if match is not None:
                return f"token:{match}"
        client = scope.get("client")
        return f"addr:{client[0] if client else 'unknown'}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.buckets is None
            or scope["type"] != "http"
            or str(scope.get("path", "")).startswith(UNLIMITED_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        wait = self.buckets.take(self.caller(scope))
        if wait <= 0:
            await self.app(scope, receive, send)
            return
        retry_after = max(1, math.ceil(wait))
        await send_json_error(
            send,
            429,
            "rate_limited",
            f"more than {self.buckets.rate:g} requests per second from this caller; "
            f"retry after {retry_after} s",
            [(b"retry-after", str(retry_after).encode())],
        )
