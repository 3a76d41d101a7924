"""`POST /v1/checkpoints` as a plain route (plain_post.py): the call a
trainer waits on at every save with disk staging. The FastAPI route in
routes.py stays the documented one; both call service.register."""

from __future__ import annotations

from typing import Any

from ..auth import Action, Principal, authorize
from ..plain_post import PlainPost
from ..resources import Resources
from .schemas import RegisterRequest
from .service import register

PATH = "/v1/checkpoints"


async def _register(
    app: Any, principal: Principal, request: RegisterRequest, _params: dict[str, str]
) -> tuple[int, bytes]:
    authorize(principal, Action.WRITE, request.run)
    resources: Resources = app.state.resources
    agent = app.state.agent
    checkpoint, created = await register(
        resources, agent.registrations, request, agent.drain, agent.inbox
    )
    return (202 if created else 200), checkpoint.model_dump_json().encode()


def register_route() -> PlainPost:
    return PlainPost(PATH, RegisterRequest, _register)
