"""Liveness and readiness probes (always open, no token needed).

While the agent drains (SIGTERM, draining.py) both still answer 200, with
``"status": "draining"`` and the seconds left: a 503 would defeat the drain.
A failed liveness probe gets the container killed mid-drain, and a failed
readiness probe makes the pod's endpoint not "serving": with the Service's
``internalTrafficPolicy: Local`` the trainer on the node then can no longer
reach its agent, whose urgent registration the drain exists for.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from ..agent import AgentProcess
from ..deps import AgentDep, ResourcesDep
from ..errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(agent: AgentDep) -> JSONResponse:
    """Alive unless a background component of the agent died (agent.py): then
    a restart is what brings its uploads, verification and retention back."""
    if agent.failures:
        dead = ", ".join(f"{f.component} ({f.reason})" for f in agent.failures)
        return JSONResponse(
            error_body("agent_component_died", f"background component(s) died: {dead}"[:1000]),
            status_code=503,
        )
    if agent.drain.active:
        return JSONResponse(_draining(agent))
    return JSONResponse({"status": "ok"})


def _draining(agent: AgentProcess) -> dict[str, object]:
    return {"status": "draining", "drain_remaining_seconds": round(agent.drain.remaining(), 1)}


@router.get("/readyz")
async def readyz(resources: ResourcesDep, agent: AgentDep) -> JSONResponse:
    try:
        async with asyncio.timeout(3):
            async with resources.engine.connect() as connection:
                await connection.execute(text("SELECT 1"))
    except Exception as exc:
        return JSONResponse(
            error_body(
                "catalog_unavailable", f"the catalog database is unreachable: {type(exc).__name__}"
            ),
            status_code=503,
        )
    node = resources.settings.server.node
    if agent.drain.active:
        return JSONResponse({**_draining(agent), "node": node})
    return JSONResponse({"status": "ready", "node": node})
