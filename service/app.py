"""The FastAPI application: resources built in the lifespan, routers mounted."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .advice.routes import router as advice_router
from .checkpoints.latest_path import LatestFastPath
from .checkpoints.routes import router as checkpoints_router
from .config import Settings
from .db import (
    create_engine,
    create_read_sessionmaker,
    create_sessionmaker,
    create_sync_readers,
    dispose_read_engine,
    dispose_sync_readers,
)
from .errors import install_error_handlers
from .health.routes import router as health_router
from .integrity.jobs import VerifyJobs
from .integrity.scrub import Scrubber
from .jobs.worker import Worker
from .limits import BodySizeLimit, RateLimit
from .observability.middleware import RequestContext
from .observability.routes import router as metrics_router
from .regions.routes import router as regions_router
from .replication.jobs import ReplicationJobs
from .resources import Resources
from .retention.jobs import DeleteJobs
from .retention.routes import router as retention_router
from .retention.sweeper import RetentionSweeper
from .runs.routes import router as runs_router
from .storage.base import StoreError
from .storage.factory import build_stores
from .ui.routes import router as ui_router
from .uploads.jobs import UploadJobs

log = logging.getLogger("tierckpt")


async def open_resources(settings: Settings, *, start_worker: bool = True) -> Resources:
    engine = create_engine(settings.catalog.url, bounded=True)
    stores = build_stores(settings)
    for store in stores.values():
        try:
            await store.ensure_ready()
        except StoreError as exc:
            # A region that is down must not stop the agent: its jobs retry.
            log.warning("region %s not ready: %s", store.region, exc)
    resources = Resources(
        settings=settings,
        engine=engine,
        sessionmaker=create_sessionmaker(engine),
        read_sessionmaker=create_read_sessionmaker(engine),
        sync_readers=create_sync_readers(engine),
        stores=stores,
    )
    if start_worker and settings.worker.enabled:
        handlers = {
            **UploadJobs(resources).handlers(),
            **ReplicationJobs(resources).handlers(),
            **VerifyJobs(resources).handlers(),
            **DeleteJobs(resources).handlers(),
        }
        resources.worker = Worker(
            resources.sessionmaker, handlers, settings.worker, settings.server.node
        )
        resources.worker.start()
        if settings.scrub.enabled:
            resources.scrubber = Scrubber(resources, settings.scrub)
            resources.scrubber.start()
        resources.sweeper = RetentionSweeper(resources)
        resources.sweeper.start()
    return resources


async def close_resources(resources: Resources) -> None:
    if resources.sweeper is not None:
        await resources.sweeper.stop()
    if resources.scrubber is not None:
        await resources.scrubber.stop()
    if resources.worker is not None:
        await resources.worker.stop()
    if resources.registrations is not None:
        await resources.registrations.close()
    await resources.stores.aclose()
    dispose_sync_readers(resources.sync_readers)
    if resources.read_sessionmaker is not None:
        await dispose_read_engine(resources.read_sessionmaker, resources.engine)
    await resources.engine.dispose()


def create_app(settings: Settings, *, start_worker: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.resources = await open_resources(settings, start_worker=start_worker)
        # Everything loaded so far (modules, the app, the ORM's mappers) lives
        # as long as the process: out of the collector's sight, a full
        # collection no longer walks it, which took tens of milliseconds and
        # was the long tail of request latency.
        gc.freeze()
        try:
            yield
        finally:
            await close_resources(app.state.resources)

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
    app.include_router(metrics_router)
    app.include_router(ui_router)
    return app
