"""POST routes answered below FastAPI's route machinery.

The calls a trainer waits on at every save (a registration; with memory
staging, reserving a segment and staging it) do little work of their own
in the agent: a scan or an arena entry, one catalog read, a record
appended. FastAPI's route machinery around them (the request object, the
body read and decoded, the dependencies solved, the body validated and the
answer wrapped) cost about as much again on a node's busy cores
(benchmarks/README.md, "Issue 16 on a fourteenth machine"). A PlainPost
does the same steps plainly: the body read and validated as the route's
model in one pass, the caller authenticated, and the route's answer
function called with the app, the principal, the request and the path's
parameters; it authorizes as the FastAPI route does and calls the same
service.

It sits in the router ahead of the FastAPI routes (app.py), inside the
exception middleware: an error of the call, of the caller or of the catalog
is worded by the same handlers as every route's. What it does not decide it
hands to the FastAPI route of the same path with the body as received: a
body that does not validate (the route words the 422), another content
type, a chunked body. The FastAPI routes stay the documented ones (OpenAPI)
and answer identically; tests hold each pair together.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send

from .auth import Principal, authenticate
from .plain_asgi import RouteLabel, authorization, header, send_json

# The answer of a plain route: (the app, the caller, the validated body, the
# path's parameters) -> (status, the JSON body).
Answer = Callable[[Any, Principal, Any, dict[str, str]], Awaitable[tuple[int, bytes]]]

# Set in a request's scope once a plain route has handed it over: the router
# then passes the plain routes by and finds FastAPI's.
_DECLINED = "tierckpt.plain_post.declined"


class PlainPost(Route):
    def __init__(self, path: str, model: type[BaseModel], answer: Answer) -> None:
        # An instance, not a function: Starlette runs it as a plain ASGI app.
        endpoint = _Endpoint(model, answer, RouteLabel(path))
        super().__init__(path, endpoint=endpoint, methods=["POST"], include_in_schema=False)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope.get(_DECLINED):
            return Match.NONE, {}
        return super().matches(scope)


class _Endpoint:
    def __init__(self, model: type[BaseModel], answer: Answer, label: RouteLabel) -> None:
        self.model = model
        self.answer = answer
        self.label = label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self.label  # the request metrics' label: the route's template
        body = await _whole_body(receive) if _plain_json(scope) else None
        request = None
        if body is not None:
            try:
                request = self.model.model_validate_json(body)
            except ValidationError:
                pass  # handed over: the FastAPI route words the 422
        if request is None:
            await _hand_over(scope, receive if body is None else _replay(body), send)
            return
        app: Any = scope["app"]
        principal = authenticate(authorization(scope), app.state.resources.settings.tokens)
        status, payload = await self.answer(app, principal, request, scope["path_params"])
        await send_json(send, status, payload)


async def _hand_over(scope: Scope, receive: Receive, send: Send) -> None:
    """To FastAPI's route: the router again, passing the plain routes by."""
    scope[_DECLINED] = True
    await scope["router"](scope, receive, send)


def _plain_json(scope: Scope) -> bool:
    """A JSON body of a declared length (what the client sends): else the
    FastAPI route reads and words it."""
    content_type = (header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
    declared = header(scope, b"content-length")
    return content_type == b"application/json" and declared is not None and declared.isdigit()


async def _whole_body(receive: Receive) -> bytes | None:
    """The request's body (the body limit's layer bounds it), or None if
    the client went away before sending it all."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive
