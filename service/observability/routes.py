"""``GET /metrics``: Prometheus text, in-process metrics plus catalog gauges.

Public by default (``[server] metrics_public = true``), as scrapers rarely
carry credentials and the figures name runs and regions but no data; with
``metrics_public = false`` a token that may read is required.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..auth import Action, authenticate, authorize
from ..deps import AgentDep, ResourcesDep
from . import metrics
from .catalog import catalog_families, render

router = APIRouter(tags=["observability"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
)
async def prometheus_metrics(
    request: Request, resources: ResourcesDep, agent: AgentDep
) -> Response:
    settings = resources.settings
    if not settings.server.metrics_public:
        principal = authenticate(request.headers.get("authorization"), settings.tokens)
        authorize(principal, Action.READ)
    metrics.init_regions([region.name for region in settings.regions])
    # The worker's families as the worker process last reported them, when
    # it runs in one (worker_process.py), added to this process's.
    body = generate_latest(metrics.with_worker(agent.worker_samples)) + render(
        await catalog_families(resources, agent.busy)
    )
    return Response(body, media_type=CONTENT_TYPE_LATEST)
