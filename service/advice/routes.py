"""HTTP route for checkpoint interval advice: parse, authorize, call the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from ..auth import Action, authorize
from ..deps import PrincipalDep, SessionDep, SettledRun
from .schemas import AdviceOut
from .service import AdviceService

router = APIRouter(prefix="/v1", tags=["advice"], dependencies=[SettledRun])


async def get_advice_service(session: SessionDep) -> AdviceService:
    return AdviceService(session)


AdviceServiceDep = Annotated[AdviceService, Depends(get_advice_service)]


@router.get("/runs/{run}/advice", response_model=AdviceOut)
async def advice(
    run: str,
    service: AdviceServiceDep,
    principal: PrincipalDep,
    mtbf_hours: Annotated[float, Query(gt=0, le=1e6, description="mean time between failures")],
    cost_seconds: Annotated[
        float | None, Query(gt=0, le=30 * 86400, description="use this checkpoint cost")
    ] = None,
    restart_seconds: Annotated[float, Query(ge=0, le=30 * 86400)] = 0.0,
    window: Annotated[int, Query(ge=2, le=1000, description="recent checkpoints used")] = 50,
) -> AdviceOut:
    """Checkpoint interval by Young's and Daly's formulas, from the run's
    observed write and upload times (see tierckpt.service.advice.service)."""
    authorize(principal, Action.READ, run)
    return await service.advise(
        run,
        mtbf_hours=mtbf_hours,
        restart_seconds=restart_seconds,
        cost_seconds=cost_seconds,
        window=window,
    )
