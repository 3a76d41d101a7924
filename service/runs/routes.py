"""HTTP routes for runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ..auth import Action, Principal
from ..checkpoints import repository as repo
from ..deps import PrincipalDep, ResourcesDep, SessionDep
from .schemas import RunOut, RunPage, RunRegionOut

router = APIRouter(prefix="/v1", tags=["runs"])


def _visible(principal: Principal, run: str) -> bool:
    return principal.allows(Action.READ, run)


@router.get("/runs", response_model=RunPage)
async def list_runs(
    session: SessionDep,
    principal: PrincipalDep,
    resources: ResourcesDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> RunPage:
    rows, total = await repo.list_runs(session, limit, offset)
    order = {region.name: i for i, region in enumerate(resources.settings.regions)}
    restart_points: dict[str, list[RunRegionOut]] = {}
    for name, region, checkpoint in await repo.last_durable_by_region(
        session, resources.settings.durability.min_regions, [run.id for run, _c, _t in rows]
    ):
        restart_points.setdefault(name, []).append(
            RunRegionOut(region=region, step=checkpoint.step, created_at=checkpoint.created_at)
        )
    runs = [
        RunOut(
            run=run.name,
            checkpoints=count,
            latest_step=top,
            created_at=run.created_at,
            regions=sorted(
                restart_points.get(run.name, []), key=lambda r: order.get(r.region, len(order))
            ),
        )
        for run, count, top in rows
        if _visible(principal, run.name)
    ]
    return RunPage(runs=runs, total=total if len(runs) == len(rows) else len(runs))
