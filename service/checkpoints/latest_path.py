"""`GET /v1/runs/{run}/latest` answered below FastAPI's routing.

`latest` is the question every restart and every orchestrator poll asks, and
profiles of the agent answering it at 100,000 checkpoints put about half of
its CPU in the framework rather than the catalog: route matching, dependency
solving, parameter validation and the response model, about as much as the
whole answer. This ASGI layer sits inside the agent's own middleware (request
id, metrics, rate limit, body limit: they all still apply) and answers the
common case itself: a valid caller, a valid run, a known region, and a valid
checkpoint to return. The answer is the same function's
(latest_answer.latest_json) as the route's.

The refusals of the catalog read itself (no valid checkpoint yet, an unknown
region) and a catalog outage are answered here too, by the same functions
as the route's exception handlers (error_responses.py): asking the route
would read the catalog twice, and an orchestrator polling a young run gets
"no valid checkpoint yet" on every poll until the first one is durable.
Anything else (no or bad token, a forbidden run, an invalid name, an odd
query string, an unexpected error) is passed on untouched to the FastAPI
route, which words those errors; the route also keeps `latest` in the
OpenAPI document. So this layer can only make an answer faster, never give
a different one.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from ..auth import Action, authenticate, authorize
from ..error_responses import api_error, catalog_unavailable
from ..errors import ApiError, is_catalog_outage
from ..names import RUN_NAME
from ..plain_asgi import RouteLabel, authorization, send_json
from ..resources import Resources
from .latest_answer import latest_json

log = logging.getLogger("tierckpt.api")

# Starlette's path converter: one segment, already percent-decoded.
PATH = re.compile(r"^/v1/runs/([^/]+)/latest$")
QUERY_KEYS = frozenset({"region", "node"})
# At most this long: a longer query string is not one a client of ours sends.
MAX_QUERY_BYTES = 512


ROUTE = RouteLabel("/v1/runs/{run}/latest")


def _query(raw: bytes) -> dict[str, str] | None:
    """region= and node=, each at most once; None for anything else."""
    if not raw:
        return {}
    if len(raw) > MAX_QUERY_BYTES:
        return None
    try:
        pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    params = dict(pairs)
    if len(params) != len(pairs) or not params.keys() <= QUERY_KEYS:
        return None
    return params


class LatestFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = None
        if scope["type"] == "http" and scope["method"] == "GET":
            match = PATH.match(scope["path"])
            if match is not None:
                try:
                    body = await self._answer(scope, match.group(1))
                except ApiError as refused:  # by the read: auth refusals go to the route
                    scope["route"] = ROUTE
                    await api_error(refused)(scope, receive, send)
                    return
                except Exception as exc:
                    if not is_catalog_outage(exc):
                        raise
                    log.warning("catalog unavailable: %s", exc)
                    scope["route"] = ROUTE
                    await catalog_unavailable()(scope, receive, send)
                    return
        if body is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = ROUTE
        await send_json(send, 200, body)

    async def _answer(self, scope: Scope, run: str) -> bytes | None:
        """The answer's bytes; None: the route answers (and words the error).
        The read's own refusals (ApiError) are raised, answered by the caller."""
        params = _query(scope["query_string"])
        if params is None or not RUN_NAME.match(run):
            return None
        app: Any = scope["app"]
        resources: Resources = app.state.resources
        try:
            principal = authenticate(authorization(scope), resources.settings.tokens)
            authorize(principal, Action.READ, run)
        except ApiError:
            return None
        try:
            return await latest_json(resources, run, params.get("region"), params.get("node"))
        except ApiError:
            raise
        except Exception as exc:
            if is_catalog_outage(exc):
                raise
            return None  # unexpected: the route logs it and words the 500
