"""HTTP routes for checkpoints: parse, authorize, call the service, shape the answer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response

from ..auth import Action, Principal, authenticate, authorize
from ..deps import (
    AgentDep,
    CheckpointServiceDep,
    PrincipalDep,
    RegistrationsDep,
    SettledRun,
    settle_run,
)
from ..memory import lookup
from ..models import CheckpointState
from ..peers.latest import newest_peer_safe
from ..resources import Resources
from .latest_answer import latest_json
from .presenter import to_json
from .schemas import (
    CheckpointOut,
    CheckpointPage,
    LatestOut,
    LineageOut,
    QuarantineRequest,
    RegisterRequest,
    RestorePlan,
)
from .service import register

router = APIRouter(prefix="/v1", tags=["checkpoints"])


async def _caller(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    # The hot path's own dependency: async (FastAPI runs a sync one in a
    # worker thread) and without a catalog session (group commit has its own).
    resources: Resources = request.app.state.resources
    return authenticate(authorization, resources.settings.tokens)


@router.post(
    "/checkpoints",
    status_code=202,
    response_model=CheckpointOut,
    responses={200: {"model": CheckpointOut, "description": "already registered, same content"}},
)
async def register_checkpoint(
    body: RegisterRequest,
    request: Request,
    principal: Annotated[Principal, Depends(_caller)],
    registrations: RegistrationsDep,
    agent: AgentDep,
) -> Response:
    authorize(principal, Action.WRITE, body.run)
    checkpoint, created = await register(
        request.app.state.resources, registrations, body, agent.drain, agent.inbox
    )
    return Response(
        checkpoint.model_dump_json(),
        status_code=202 if created else 200,
        media_type="application/json",
    )


@router.get("/runs/{run}/checkpoints", response_model=CheckpointPage, dependencies=[SettledRun])
async def list_checkpoints(
    run: str,
    service: CheckpointServiceDep,
    principal: PrincipalDep,
    state: Annotated[list[CheckpointState] | None, Query()] = None,
    min_step: Annotated[int | None, Query(ge=0)] = None,
    max_step: Annotated[int | None, Query(ge=0)] = None,
    pinned: bool | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> CheckpointPage:
    authorize(principal, Action.READ, run)
    checkpoints, total = await service.list(
        run,
        states=[s.value for s in state] if state else None,
        min_step=min_step,
        max_step=max_step,
        limit=limit,
        offset=offset,
        pinned=pinned,
    )
    return CheckpointPage(checkpoints=checkpoints, total=total)


@router.get("/runs/{run}/checkpoints/{step}", response_model=CheckpointOut)
async def get_checkpoint(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep, agent: AgentDep
) -> CheckpointOut:
    authorize(principal, Action.READ, run)
    return await lookup.detail(service, agent.memory, run, step, agent.inbox)


@router.get("/runs/{run}/latest", response_model=LatestOut)
async def latest_checkpoint(
    run: str,
    request: Request,
    principal: PrincipalDep,
    service: CheckpointServiceDep,
    agent: AgentDep,
    region: str | None = None,
    node: str | None = None,
    scope: Literal["durable", "node"] = "durable",
    peer_safe: bool = False,
) -> Response:
    """The newest durable checkpoint; with ``scope=node`` (and ``node=``)
    the newest one that node holds in memory or on T0, even if not durable
    (memory/lookup.py says what that risks); with ``peer_safe=true`` the
    newest peer-safe one when it is newer (peers/latest.py: the rule, the risk)."""
    authorize(principal, Action.READ, run)
    if peer_safe and scope == "durable":
        document = await peer_safe_latest(service, run)
        if document is not None:
            return Response(to_json(document), media_type="application/json")
    if scope == "node":
        await settle_run(request, agent)  # the node's newest may be only recorded
        document = await lookup.node_latest(
            request.app.state.resources, service, agent.memory, run, node, region
        )
        return Response(to_json(document), media_type="application/json")
    # Usually answered below the routing (latest_path.py); here it is asked
    # by requests that path passes on, so the errors are worded in one place.
    body = await latest_json(request.app.state.resources, run, region, node)
    return Response(body, media_type="application/json")


async def peer_safe_latest(service: CheckpointServiceDep, run: str) -> dict[str, Any] | None:
    """The newest peer-safe checkpoint newer than the newest durable, as a
    LatestOut document (no region location yet, no T0 copy asked for)."""
    peers = service.settings.peers
    found = await newest_peer_safe(service.session, run, peers.copies, peers.lease_seconds)
    if found is None:
        return None
    out = await service.describe(run, found, with_files=False)
    document = out.model_dump(mode="json")
    document["peer_safe"] = True
    return {**document, "locations": [], "local": None}


@router.get(
    "/runs/{run}/checkpoints/{step}/download", response_model=RestorePlan, dependencies=[SettledRun]
)
async def restore_plan(
    run: str,
    step: int,
    service: CheckpointServiceDep,
    principal: PrincipalDep,
    region: str | None = None,
    rank: Annotated[int | None, Query(ge=0)] = None,
    chunks: bool = False,
) -> RestorePlan:
    authorize(principal, Action.READ, run)
    return await service.restore_plan(run, step, region, rank, chunks)


@router.post(
    "/runs/{run}/checkpoints/{step}/verify",
    status_code=202,
    response_model=CheckpointOut,
    dependencies=[SettledRun],
)
async def verify_checkpoint(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep
) -> CheckpointOut:
    """Re-read and re-hash every region's copy (asynchronously); the answer
    lists the queued verify jobs, the detail view shows their outcome."""
    authorize(principal, Action.WRITE, run)
    return await service.verify(run, step)


@router.get(
    "/runs/{run}/checkpoints/{step}/lineage", response_model=LineageOut, dependencies=[SettledRun]
)
async def checkpoint_lineage(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep
) -> LineageOut:
    """The ancestor chain (across runs, parent first) and the direct children."""
    authorize(principal, Action.READ, run)
    return await service.lineage(run, step)


@router.post(
    "/runs/{run}/checkpoints/{step}/pin", response_model=CheckpointOut, dependencies=[SettledRun]
)
async def pin_checkpoint(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep
) -> CheckpointOut:
    authorize(principal, Action.ADMIN, run)
    return await service.set_pinned(run, step, True)


@router.delete(
    "/runs/{run}/checkpoints/{step}/pin", response_model=CheckpointOut, dependencies=[SettledRun]
)
async def unpin_checkpoint(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep
) -> CheckpointOut:
    authorize(principal, Action.ADMIN, run)
    return await service.set_pinned(run, step, False)


@router.post(
    "/runs/{run}/checkpoints/{step}/quarantine",
    response_model=CheckpointOut,
    dependencies=[SettledRun],
)
async def quarantine_checkpoint(
    run: str,
    step: int,
    body: QuarantineRequest,
    service: CheckpointServiceDep,
    principal: PrincipalDep,
) -> CheckpointOut:
    """Mark a checkpoint bad (e.g. training diverged from it): `latest` skips it."""
    authorize(principal, Action.ADMIN, run)
    return await service.quarantine(run, step, body.reason)


@router.delete(
    "/runs/{run}/checkpoints/{step}/quarantine",
    response_model=CheckpointOut,
    dependencies=[SettledRun],
)
async def release_quarantine(
    run: str, step: int, service: CheckpointServiceDep, principal: PrincipalDep
) -> CheckpointOut:
    authorize(principal, Action.ADMIN, run)
    return await service.quarantine(run, step, None)


@router.delete(
    "/runs/{run}/checkpoints/{step}",
    status_code=202,
    response_model=CheckpointOut,
    dependencies=[SettledRun],
)
async def delete_checkpoint(
    run: str,
    step: int,
    service: CheckpointServiceDep,
    principal: PrincipalDep,
    force: bool = False,
) -> CheckpointOut:
    """Remove it from every region (manifest first); the row stays as `deleted`.
    Pinned ones are refused; the latest valid one only with force=true."""
    authorize(principal, Action.ADMIN, run)
    return await service.delete(run, step, principal.name, force)
