"""Per-run retention: read the effective policy, override it, apply it now."""

from __future__ import annotations

from fastapi import APIRouter

from ..auth import Action, authorize
from ..config import RetentionPolicySettings
from ..deps import PrincipalDep, ResourcesDep, SessionDep, SettledRun
from .schemas import RetentionApplied, RetentionOut
from .service import apply_retention_now, override_retention, run_retention

router = APIRouter(prefix="/v1/runs", tags=["retention"], dependencies=[SettledRun])


@router.get("/{run}/retention", response_model=RetentionOut)
async def get_retention(
    run: str, session: SessionDep, resources: ResourcesDep, principal: PrincipalDep
) -> RetentionOut:
    authorize(principal, Action.READ, run)
    return await run_retention(session, resources, run)


@router.put("/{run}/retention", response_model=RetentionOut)
async def put_retention(
    run: str,
    body: RetentionPolicySettings,
    session: SessionDep,
    resources: ResourcesDep,
    principal: PrincipalDep,
) -> RetentionOut:
    authorize(principal, Action.ADMIN, run)
    return await override_retention(session, resources, run, body)


@router.post("/{run}/retention/apply", response_model=RetentionApplied)
async def apply_retention(
    run: str, session: SessionDep, resources: ResourcesDep, principal: PrincipalDep
) -> RetentionApplied:
    """Apply the policy now instead of at the next periodic pass."""
    authorize(principal, Action.ADMIN, run)
    return await apply_retention_now(session, resources, run)
