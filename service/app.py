"""The FastAPI application: resources and the agent built in the lifespan, routers mounted."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .advice.routes import router as advice_router
from .agent import AgentProcess
from .checkpoints.latest_path import LatestFastPath
from .checkpoints.register_path import register_route
from .checkpoints.routes import router as checkpoints_router
from .config import Settings
from .error_responses import install_error_handlers
from .health.routes import router as health_router
from .limits import BodySizeLimit, RateLimit
from .memory.routes import plain_routes as memory_plain_routes
from .memory.routes import router as memory_router
from .observability.middleware import RequestContext
from .observability.routes import router as metrics_router
from .peers.routes import router as peers_router
from .prefetch.routes import router as prefetch_router
from .regions.routes import router as regions_router
from .resources import close_resources, open_resources
from .retention.routes import router as retention_router
from .runs.routes import router as runs_router
from .ui.routes import router as ui_router


def create_app(
    settings: Settings, *, start_worker: bool = True, worker_process: bool = False
) -> FastAPI:
    """``worker_process``: allow the worker its own process (``[worker]
    separate_process``); `tierckpt serve` does, an app driven in process by
    the tests keeps everything in one."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        resources = await open_resources(settings)
        try:
            agent = AgentProcess.assemble(
                resources, start_worker=start_worker, worker_process=worker_process
            )
            app.state.resources, app.state.agent = resources, agent
            agent.start()
            # Everything loaded so far (modules, the app, the ORM's mappers)
            # lives as long as the process: out of the collector's sight, a
            # full collection no longer walks it, which took tens of
            # milliseconds and was the long tail of request latency.
            gc.freeze()
            try:
                yield
            finally:
                await agent.close()
        finally:
            await close_resources(resources)

    app = FastAPI(
        title="tierckpt",
        version="0.1.0",
        summary="Tiered checkpoint storage for ML training",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    # Innermost: `latest` below the routing, inside every layer added after it.
    app.add_middleware(LatestFastPath)
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_body_bytes)
    # Added last = outermost: a throttled caller costs no body read.
    app.add_middleware(
        RateLimit,
        rate=settings.server.rate_limit_per_second,
        burst=settings.server.rate_limit_burst,
        tokens=settings.tokens,
    )
    # Outermost: every answer (a 429 too) carries X-Request-ID and is counted.
    app.add_middleware(RequestContext)
    app.include_router(health_router)
    app.include_router(checkpoints_router)
    app.include_router(runs_router)
    app.include_router(retention_router)
    app.include_router(regions_router)
    app.include_router(advice_router)
    app.include_router(memory_router)
    app.include_router(peers_router)
    app.include_router(prefetch_router)
    app.include_router(metrics_router)
    app.include_router(ui_router)
    # First in the router: a save's calls below FastAPI's route machinery.
    app.router.routes[:0] = [register_route(), *memory_plain_routes()]
    return app
