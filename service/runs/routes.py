"""HTTP routes for runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ..auth import Action, Principal
from ..checkpoints import repository as repo
from ..deps import PrincipalDep, SessionDep
from .schemas import RunOut, RunPage

router = APIRouter(prefix="/v1", tags=["runs"])


def _visible(principal: Principal, run: str) -> bool:
    return principal.allows(Action.READ, run)


@router.get("/runs", response_model=RunPage)
async def list_runs(
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> RunPage:
    rows, total = await repo.list_runs(session, limit, offset)
    runs = [
        RunOut(run=run.name, checkpoints=count, latest_step=top, created_at=run.created_at)
        for run, count, top in rows
        if _visible(principal, run.name)
    ]
    return RunPage(runs=runs, total=total if len(runs) == len(rows) else len(runs))
