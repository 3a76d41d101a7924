"""`POST /v1/checkpoints` answered by a plain ASGI route ahead of FastAPI's.

A registration is the call a trainer waits on at every save. Around the
agent's own work (a scan, one catalog read, a record appended), FastAPI's
route machinery (the request object, the body read and decoded, four
dependencies solved, the body validated and the answer wrapped) cost about
as much again on a node's busy cores (benchmarks/README.md, "Issue 16 on a
fourteenth machine"). This route does the same steps plainly: the body is
read and validated as a RegisterRequest in one pass, the caller
authenticated and authorized, and checkpoints/service.register answers,
as the route would call it.

It sits in the router (app.py puts it first), inside the exception
middleware: an error of the registration, of the caller or of the catalog
is worded by the same handlers as every route's. What it does not decide,
it hands to the FastAPI route with the body as received: a body that does
not validate (the route words the 422), another content type, a
chunked body. The FastAPI route stays the documented one (OpenAPI) and
answers identically; tests hold the two together.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send

from ..auth import Action, authenticate, authorize
from ..plain_asgi import RouteLabel, authorization, header, send_json
from ..resources import Resources
from .schemas import RegisterRequest
from .service import register

PATH = "/v1/checkpoints"


# Set in a request's scope once this route has handed it over: the router
# then passes this route by and finds FastAPI's.
_DECLINED = "tierckpt.register_path.declined"


# The request metrics' label: the documented route's template.
ROUTE = RouteLabel(PATH)


class RegisterRoute(Route):
    def __init__(self) -> None:
        # An instance, not a function: Starlette runs it as a plain ASGI app.
        super().__init__(PATH, endpoint=_Register(), methods=["POST"], include_in_schema=False)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope.get(_DECLINED):
            return Match.NONE, {}
        return super().matches(scope)


class _Register:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = ROUTE
        body = await _whole_body(receive) if _plain_json(scope) else None
        request = None
        if body is not None:
            try:
                request = RegisterRequest.model_validate_json(body)
            except ValidationError:
                request = None
        if request is None:
            await _hand_over(scope, receive if body is None else _replay(body), send)
            return
        app: Any = scope["app"]
        resources: Resources = app.state.resources
        agent = app.state.agent
        principal = authenticate(authorization(scope), resources.settings.tokens)
        authorize(principal, Action.WRITE, request.run)
        checkpoint, created = await register(
            resources, agent.registrations, request, agent.drain, agent.inbox
        )
        payload = checkpoint.model_dump_json().encode()
        await send_json(send, 202 if created else 200, payload)


async def _hand_over(scope: Scope, receive: Receive, send: Send) -> None:
    """To FastAPI's route: the router again, passing this one by."""
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
