"""Per-run retention: read the effective policy, override it, apply it now."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from ..auth import Action, authorize
from ..checkpoints import repository as repo
from ..config import RetentionPolicySettings
from ..deps import PrincipalDep, ResourcesDep, SessionDep
from ..errors import NotFound
from .service import apply_run, effective_policy, plan_for_run

router = APIRouter(prefix="/v1/runs", tags=["retention"])


class RetentionOut(BaseModel):
    run: str
    policy: RetentionPolicySettings
    overridden: bool  # False: the server's [retention] default applies
    would_delete: list[int]


class RetentionApplied(BaseModel):
    run: str
    delete_queued: list[int]


async def _run(session: SessionDep, name: str):  # type: ignore[no-untyped-def]
    run = await repo.find_run(session, name)
    if run is None:
        raise NotFound(f"run {name!r} has no checkpoints", code="run_not_found")
    return run


@router.get("/{run}/retention", response_model=RetentionOut)
async def get_retention(
    run: str, session: SessionDep, resources: ResourcesDep, principal: PrincipalDep
) -> RetentionOut:
    authorize(principal, Action.READ, run)
    row = await _run(session, run)
    plan = await plan_for_run(session, row, resources)
    return RetentionOut(
        run=run,
        policy=effective_policy(row, resources),
        overridden=row.retention is not None,
        would_delete=sorted(plan.delete),
    )


@router.put("/{run}/retention", response_model=RetentionOut)
async def put_retention(
    run: str,
    body: RetentionPolicySettings,
    session: SessionDep,
    resources: ResourcesDep,
    principal: PrincipalDep,
) -> RetentionOut:
    authorize(principal, Action.ADMIN, run)
    row = await repo.get_or_create_run(session, run)
    row.retention = body.model_dump(exclude_none=True)
    await session.commit()
    return await get_retention(run, session, resources, principal)


@router.post("/{run}/retention/apply", response_model=RetentionApplied)
async def apply_retention(
    run: str, session: SessionDep, resources: ResourcesDep, principal: PrincipalDep
) -> RetentionApplied:
    """Apply the policy now instead of at the next periodic pass."""
    authorize(principal, Action.ADMIN, run)
    row = await _run(session, run)
    queued = await apply_run(session, row, resources)
    await session.commit()
    resources.wake_worker()
    return RetentionApplied(run=run, delete_queued=queued)
