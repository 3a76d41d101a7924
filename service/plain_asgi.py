"""What the agent's plain ASGI layers (the request limits, the hot paths of
`latest` and register) share: reading a request header, answering with a
JSON body, and the route label the request metrics read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import Scope, Send


def header(scope: Scope, name: bytes) -> bytes | None:
    """The request header ``name`` (lower case), its first value."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def authorization(scope: Scope) -> str | None:
    """The Authorization header, as auth.authenticate takes it."""
    value = header(scope, b"authorization")
    return None if value is None else value.decode("latin-1")


async def send_json(
    send: Send, status: int, payload: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with ``payload``, JSON already encoded."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


@dataclass(frozen=True)
class RouteLabel:
    """Put in scope["route"] by a layer that answers itself: the request
    metrics label a request by its route's template (observability/
    middleware.py), as for FastAPI's routes."""

    path: str
