"""HTTP routes of the memory tier: the arena, reserving a segment, staging it.

Reserving and staging are on a memory-staged save's path: each also has a
plain route (plain_post.py) that answers ahead of FastAPI's, as these do."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from ..auth import Action, Principal, authorize
from ..checkpoints.presenter import to_json
from ..deps import AgentDep, PrincipalDep
from ..errors import Conflict
from ..plain_post import PlainPost
from .service import MemoryTier, ReserveRequest, SegmentOut, StageRequest

router = APIRouter(prefix="/v1/memory", tags=["memory"])
SEGMENTS, STAGE = "/segments", "/segments/{segment_id}/register"


def _tier(agent: AgentDep) -> MemoryTier:
    if agent.memory is None:
        raise Conflict(
            "this agent has no memory tier ([memory] bytes = 0, or it runs no worker); "
            "write the checkpoint to T0 and register it",
            code="memory_off",
        )
    return agent.memory


@router.get("")
async def memory_info(agent: AgentDep, principal: PrincipalDep) -> dict[str, Any]:
    """The arena: budget, bytes in use, the policy when full, the segments."""
    authorize(principal, Action.READ)
    if agent.memory is None:
        return {"enabled": False, "node": agent.resources.settings.server.node}
    info = agent.memory.info()
    info["segments"] = [s for s in info["segments"] if principal.allows(Action.READ, s["run"])]
    return info


@router.post(SEGMENTS, status_code=201, response_model=SegmentOut)
async def reserve_segment(
    body: ReserveRequest, agent: AgentDep, principal: PrincipalDep
) -> SegmentOut:
    """Reserve room for a checkpoint's files; 507 `memory_full` (or
    `segment_too_large`) when the arena cannot hold them now."""
    authorize(principal, Action.WRITE, body.run)
    return _tier(agent).reserve(body)


@router.post(STAGE, status_code=202)
async def register_segment(
    segment_id: str, body: StageRequest, agent: AgentDep, principal: PrincipalDep
) -> Response:
    """The segment's files are complete: record the registration (the
    checkpoint is `staged`); the agent registers it, uploads it from memory
    and writes it to T0.
    With `reserve_next`, the answer's `next_segment` is a segment of the same
    files reserved for the run's next save (null when the arena has no room
    for it without evicting a checkpoint's copy): that save writes into it
    and stages it with no reservation call."""
    authorize(principal, Action.WRITE, body.run)
    document = _tier(agent).stage(segment_id, body)
    return Response(to_json(document), status_code=202, media_type="application/json")


@router.delete("/segments/{segment_id}")
async def release_segment(
    segment_id: str, agent: AgentDep, principal: PrincipalDep
) -> dict[str, str]:
    """Give back a reservation that will not be registered (a failed save)."""
    authorize(principal, Action.WRITE)  # the role first, the run once it is known
    tier = _tier(agent)
    authorize(principal, Action.WRITE, tier.arena.get(segment_id).run)
    tier.release(segment_id)
    return {"released": segment_id}


async def _plain_reserve(
    app: Any, principal: Principal, body: ReserveRequest, _params: dict[str, str]
) -> tuple[int, bytes]:
    authorize(principal, Action.WRITE, body.run)
    return 201, _tier(app.state.agent).reserve(body).model_dump_json().encode()


async def _plain_stage(
    app: Any, principal: Principal, body: StageRequest, params: dict[str, str]
) -> tuple[int, bytes]:
    authorize(principal, Action.WRITE, body.run)
    return 202, to_json(_tier(app.state.agent).stage(params["segment_id"], body))


def plain_routes() -> list[PlainPost]:
    """Reserve and stage below FastAPI's route machinery (plain_post.py)."""
    return [
        PlainPost(router.prefix + SEGMENTS, ReserveRequest, _plain_reserve),
        PlainPost(router.prefix + STAGE, StageRequest, _plain_stage),
    ]
