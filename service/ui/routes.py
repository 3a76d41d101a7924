"""Dashboard pages: ``/ui`` (runs and their recovery point) and
``/ui/runs/{run}`` (timeline, replication lag, failures, lineage).

Auth, when ``[[tokens]]`` are configured: a token that may read, from the
``Authorization: Bearer`` header (scripts) or from the ``tierckpt_ui`` cookie.
A person opens ``/ui?token=…`` once (or types it into the sign-in form): the
token is checked, stored in an HttpOnly, SameSite=Strict session cookie
scoped to ``/ui``, and the browser is redirected to the same page without it,
so it does not stay in the address bar or the history. Runs the token may
not read are not listed; their pages answer 403. With no tokens configured
(loopback-only agent) every page is open.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import DictLoader, Environment, select_autoescape

from ..auth import Action, Principal, authenticate
from ..deps import ResourcesDep, SessionDep, SettledRun, SettledRuns
from ..errors import Unauthorized
from ..models import utcnow
from . import svg
from .service import overview, run_view_named
from .templates import TEMPLATES

router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[SettledRun])

COOKIE = "tierckpt_ui"
SECURITY_HEADERS = {
    # No script at all; styles and SVG are inline.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
RPO_WARN_SECONDS = 3600
RPO_BAD_SECONDS = 6 * 3600


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    return f"{svg.duration((utcnow() - value).total_seconds())} ago"


def _rpo_class(value: datetime | None) -> str:
    if value is None:
        return "bad"
    age = (utcnow() - value).total_seconds()
    return "bad" if age > RPO_BAD_SECONDS else "warn" if age > RPO_WARN_SECONDS else "ok"


ENV = Environment(loader=DictLoader(TEMPLATES), autoescape=select_autoescape(default=True))
ENV.globals.update(ago=_ago, rpo_class=_rpo_class, duration=svg.duration, size=svg.size)


class _Denied(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def _page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    resources = request.app.state.resources
    refresh = request.query_params.get("refresh", "")
    html = ENV.get_template(name).render(
        node=resources.settings.server.node,
        now_text=utcnow().strftime("%Y-%m-%d %H:%M:%S"),
        refresh=int(refresh) if refresh.isdigit() and 5 <= int(refresh) <= 3600 else None,
        can_logout=bool(resources.settings.tokens),
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def _principal(request: Request, token: str | None) -> Principal:
    """The caller, or _Denied with the page to answer instead."""
    tokens = request.app.state.resources.settings.tokens
    if not tokens:
        return authenticate(None, tokens)
    if token:
        try:
            authenticate(f"Bearer {token}", tokens)
        except Unauthorized:
            raise _Denied(_login(request, "That token is not valid.", 401)) from None
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        redirect = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
        redirect.set_cookie(
            COOKIE,
            token,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        raise _Denied(redirect)
    header = request.headers.get("authorization")
    cookie = request.cookies.get(COOKIE)
    if header is None and cookie is None:
        raise _Denied(_login(request, "This agent requires a token.", 401))
    try:
        return authenticate(header or f"Bearer {cookie}", tokens)
    except Unauthorized:
        raise _Denied(_login(request, "The token is no longer valid.", 401)) from None


def _login(request: Request, message: str, status: int) -> HTMLResponse:
    response = _page(request, "login.html", status, message=message, action=request.url.path)
    response.headers["WWW-Authenticate"] = 'Bearer realm="tierckpt"'
    response.delete_cookie(COOKIE, path="/ui")
    return response


TokenQuery = Annotated[str | None, Query(description="once: stored in a cookie")]


@router.get("", response_class=HTMLResponse, dependencies=[SettledRuns])
async def runs_page(
    request: Request, resources: ResourcesDep, session: SessionDep, token: TokenQuery = None
) -> Response:
    try:
        principal = _principal(request, token)
    except _Denied as denied:
        return denied.response
    view = await overview(
        session, resources.settings, lambda run: principal.allows(Action.READ, run)
    )
    return _page(
        request,
        "index.html",
        view=view,
        regions=[region.name for region in resources.settings.regions],
        queued=sum(n for (_kind, state), n in view.jobs.items() if state == "queued"),
        running=sum(n for (_kind, state), n in view.jobs.items() if state == "running"),
    )


@router.get("/runs/{run}", response_class=HTMLResponse)
async def run_page(
    run: str,
    request: Request,
    resources: ResourcesDep,
    session: SessionDep,
    token: TokenQuery = None,
) -> Response:
    try:
        principal = _principal(request, token)
    except _Denied as denied:
        return denied.response
    if not principal.allows(Action.READ, run):
        return _page(
            request,
            "error.html",
            403,
            heading="403 forbidden",
            message=f"token {principal.name!r} may not read run {run!r}",
        )
    view = await run_view_named(session, resources.settings, run)
    if view is None:
        return _page(
            request, "error.html", 404, heading="404", message=f"run {run!r} has no checkpoints"
        )
    return _page(
        request,
        "run.html",
        view=view,
        timeline=svg.timeline(view.checkpoints, view.regions),
        lineage=svg.lineage(view.lineage_nodes, view.lineage_edges, view.name),
    )


@router.get("/logout")
async def logout() -> Response:
    response = RedirectResponse("/ui", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path="/ui")
    return response
