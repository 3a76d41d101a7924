"""Runs: the list of runs a caller may read, with where each restarts from."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from ..auth import Action, Principal
from ..checkpoints import repository as repo
from ..config import Settings
from .schemas import RunOut, RunPage, RunRegionOut


async def runs_page(
    session: AsyncSession, settings: Settings, principal: Principal, limit: int, offset: int
) -> RunPage:
    """One page of runs (by name), each with its newest valid checkpoint per
    region in configuration order; runs the caller may not read are left out."""
    rows, total = await repo.list_runs(session, limit, offset)
    order = {region.name: i for i, region in enumerate(settings.regions)}
    restart_points: dict[str, list[RunRegionOut]] = {}
    for name, region, checkpoint in await repo.last_durable_by_region(
        session, settings.durability.min_regions, [run.id for run, _c, _t in rows]
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
        if principal.allows(Action.READ, run.name)
    ]
    return RunPage(runs=runs, total=total if len(runs) == len(rows) else len(runs))
