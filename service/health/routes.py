"""Liveness and readiness probes (always open, no token needed)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from ..deps import ResourcesDep
from ..errors import error_body

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> JSONResponse:
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
    return JSONResponse({"status": "ready", "node": resources.settings.server.node})
