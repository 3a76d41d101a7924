"""Per-request context: a request id, an access log line, HTTP metrics.

A pure ASGI middleware (no BaseHTTPMiddleware: streamed responses stay
streamed, and the context variable is set in the task that runs the route).
An incoming ``X-Request-ID`` made of safe characters is kept, so a request can
be followed from a proxy or a client through the agent's log; otherwise a new
one is made. Either way the response carries it, and a ``Server-Timing``
header (``app;dur=`` milliseconds from the request's arrival here to its
answer's headers): the agent's own share of what a client waited, per
request, without its log (which leaves quiet GETs at DEBUG).

Access lines go to ``tierckpt.http``: writes, errors and slow requests at
INFO, the rest (clients poll checkpoint state several times a second) at
DEBUG. The query string is never logged (the dashboard accepts ``?token=``).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import metrics
from .context import REQUEST_FACTS, REQUEST_ID

log = logging.getLogger("tierckpt.http")

HEADER = b"x-request-id"
TIMING = b"server-timing"
_SAFE_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
SLOW_SECONDS = 1.0


# 16 hex characters: 8 random per process, then a counter. Unique within the
# process and (by the random half) across agents, without a getrandom call
# per request, which would be a visible share of a `latest` answer's CPU.
_PROCESS_PART = os.urandom(4).hex()
_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_PROCESS_PART}{next(_COUNTER) & 0xFFFFFFFF:08x}"


def _route(scope: Scope) -> str:
    """The route template (bounded label values), not the raw path."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    return "unmatched"


class RequestContext:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(HEADER)
        request_id = (
            incoming.decode() if incoming and _SAFE_ID.match(incoming) else new_request_id()
        )
        token = REQUEST_ID.set(request_id)
        facts: dict[str, Any] = {}
        facts_token = REQUEST_FACTS.set(facts)
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                ours = (HEADER, TIMING)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in ours]
                headers.append((HEADER, request_id.encode()))
                took = (time.monotonic() - started) * 1000
                headers.append((TIMING, f"app;dur={took:.2f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.monotonic() - started
            method = scope.get("method", "GET")
            metrics.observe_request(method, _route(scope), status, seconds)
            quiet = method in ("GET", "HEAD") and status < 400 and seconds < SLOW_SECONDS
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "%s %s %d %.1f ms",
                method,
                scope.get("path", ""),
                status,
                seconds * 1000,
                extra={
                    **facts,
                    "method": method,
                    "path": scope.get("path", ""),
                    "status": status,
                    "duration_ms": round(seconds * 1000, 2),
                },
            )
            REQUEST_FACTS.reset(facts_token)
            REQUEST_ID.reset(token)
