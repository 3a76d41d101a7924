"""HTTP routes for runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ..deps import PrincipalDep, ResourcesDep, SessionDep, SettledRun, SettledRuns
from .schemas import RunPage
from .service import runs_page

router = APIRouter(prefix="/v1", tags=["runs"], dependencies=[SettledRun])


@router.get("/runs", response_model=RunPage, dependencies=[SettledRuns])
async def list_runs(
    session: SessionDep,
    principal: PrincipalDep,
    resources: ResourcesDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> RunPage:
    return await runs_page(session, resources.settings, principal, limit, offset)
