"""HTTP routes for prefetching a checkpoint into nodes' T0 before a restart."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ..auth import Action, authorize
from ..deps import PrincipalDep, ResourcesDep, SessionDep, SettledRun
from .schemas import MAX_NODES, PrefetchOut, PrefetchPage, PrefetchRequest
from .service import prefetch_status, request_prefetch

router = APIRouter(prefix="/v1", tags=["prefetch"], dependencies=[SettledRun])


@router.post("/runs/{run}/prefetch", status_code=202, response_model=PrefetchOut)
async def prefetch(
    run: str,
    body: PrefetchRequest,
    session: SessionDep,
    principal: PrincipalDep,
    resources: ResourcesDep,
) -> PrefetchOut:
    authorize(principal, Action.WRITE, run)
    out = await request_prefetch(session, resources, run, body)
    await session.commit()
    resources.wake()
    return out


@router.get("/runs/{run}/prefetch", response_model=PrefetchPage)
async def prefetch_jobs(
    run: str,
    session: SessionDep,
    principal: PrincipalDep,
    step: Annotated[int | None, Query(ge=0)] = None,
    # Up to one request's nodes: a caller following its jobs sees them all.
    limit: Annotated[int, Query(ge=1, le=MAX_NODES)] = 100,
) -> PrefetchPage:
    authorize(principal, Action.READ, run)
    return await prefetch_status(session, run, step, limit)
