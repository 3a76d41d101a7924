"""Bearer-token auth through HTTP, on every route of the app's own OpenAPI schema.

401 without a token, with a wrong one or with another scheme; 403 when the
token's role or run pattern does not cover the route; the probes stay open.
The route table below must name every operation the app serves: a new route
fails `test_every_route_is_in_the_table` until someone decides its role.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import Agent, running_agent, token_entry, write_checkpoint

ADMIN, TRAINER, READER = "admin-secret", "trainer-secret", "reader-secret"
PEER = "peer-secret"
TOKENS = [
    token_entry("ops", ADMIN, "admin"),
    token_entry("trainers", TRAINER, "trainer", runs="llama-*"),
    token_entry("dashboards", READER, "reader", runs="llama-*"),
    token_entry("agents", PEER, "peer"),
]
READ, WRITE, ADMIN_ONLY = 1, 2, 3
ROLE_LEVEL = {"reader": READ, "trainer": WRITE, "admin": ADMIN_ONLY}
# A step that does not exist: an authorized request gets past auth and ends
# in a 404 (or 400), without changing anything.
MISSING = 999


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI template
    action: int
    body: Any = None
    params: dict[str, Any] | None = None

    def url(self, run: str) -> str:
        return (
            self.path.replace("{run}", run)
            .replace("{step}", str(MISSING))
            .replace("{region}", "local")
            .replace("{key}", f"{run}/step-000000000001/rank-00000/w.bin")
            .replace("{segment_id}", "no-such-segment")
            .replace("{shard_id}", str(MISSING))
            .replace("{path}", "w.bin")
        )

    def request_body(self, run: str, ssd: Path) -> Any:
        if callable(self.body):
            return self.body(run, ssd)
        return self.body


ROUTES = [
    Route(
        "POST",
        "/v1/checkpoints",
        WRITE,
        lambda run, ssd: {"run": run, "step": MISSING, "path": str(ssd / "does-not-exist")},
    ),
    Route("GET", "/v1/runs/{run}/checkpoints", READ),
    Route("GET", "/v1/runs/{run}/checkpoints/{step}", READ),
    Route("GET", "/v1/runs/{run}/latest", READ),
    Route("GET", "/v1/runs/{run}/checkpoints/{step}/download", READ),
    Route("GET", "/v1/runs/{run}/checkpoints/{step}/lineage", READ),
    Route("POST", "/v1/runs/{run}/checkpoints/{step}/verify", WRITE),
    Route("DELETE", "/v1/runs/{run}/checkpoints/{step}", ADMIN_ONLY),
    Route("POST", "/v1/runs/{run}/checkpoints/{step}/pin", ADMIN_ONLY),
    Route("DELETE", "/v1/runs/{run}/checkpoints/{step}/pin", ADMIN_ONLY),
    Route("POST", "/v1/runs/{run}/checkpoints/{step}/quarantine", ADMIN_ONLY, {"reason": "x"}),
    Route("DELETE", "/v1/runs/{run}/checkpoints/{step}/quarantine", ADMIN_ONLY),
    Route("GET", "/v1/runs/{run}/retention", READ),
    Route("PUT", "/v1/runs/{run}/retention", ADMIN_ONLY, {"keep_last": 3}),
    Route("POST", "/v1/runs/{run}/retention/apply", ADMIN_ONLY),
    Route("GET", "/v1/regions/{region}/objects/{key}", READ),
    Route("GET", "/v1/runs/{run}/advice", READ, params={"mtbf_hours": 24}),
    # A prefetch of a step that does not exist: 404 once allowed.
    Route("POST", "/v1/runs/{run}/prefetch", WRITE, {"nodes": ["node-x"], "step": MISSING}),
    Route("GET", "/v1/runs/{run}/prefetch", READ),
    # The memory tier: the run is in the body; an allowed call ends in a 400
    # (a path that is refused) or a 404 (no such segment).
    Route(
        "POST",
        "/v1/memory/segments",
        WRITE,
        lambda run, ssd: {"run": run, "step": MISSING, "files": [{"path": "../x", "size": 1}]},
    ),
    Route(
        "POST",
        "/v1/memory/segments/{segment_id}/register",
        WRITE,
        lambda run, ssd: {"run": run, "step": MISSING, "path": str(ssd / "does-not-exist")},
    ),
]
# Not tied to one run: listing is filtered by the token's pattern instead.
UNSCOPED = [
    Route("GET", "/v1/runs", READ),
    # Segments named by id (their run is known once found) and the arena's
    # state (its list filtered by the token's runs).
    Route("GET", "/v1/memory", READ),
    Route("DELETE", "/v1/memory/segments/{segment_id}", WRITE),
    Route("GET", "/v1/agents", READ),
    # A peer copy is read by whoever may read its shard's run.
    Route("GET", "/v1/peers/shards/{shard_id}/files/{path}", READ),
]
# Only a peer token may push peer copies, and it may do nothing else.
PEER_PUSH = [
    Route("PUT", "/v1/peers/shards/{shard_id}/files/{path}", 0, b"bytes"),
    Route("POST", "/v1/peers/shards/{shard_id}/commit", 0),
]
OPEN = {("GET", "/healthz"), ("GET", "/readyz")}
# Open or not by configuration ([server] metrics_public): its own test below.
CONFIGURED = {("GET", "/metrics")}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    async with running_agent(
        f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
        tmp_path,
        tokens=TOKENS,
        # This module is about auth, not throttling.
        server={"rate_limit_per_second": 0},
    ) as running:
        for run in ("llama-7b", "gpt-2"):
            ckpt = write_checkpoint(running.ssd / run / "step-1", {"w.bin": b"weights"})
            answer = await running.http.post(
                "/v1/checkpoints",
                json={"run": run, "step": 1, "path": str(ckpt)},
                headers=bearer(ADMIN),
            )
            # Answered from the agent's inbox (SQLite's default), written to
            # the catalog behind the answer: the listings below wait for it.
            assert answer.status_code == 202, answer.text
        yield running


async def call(agent: Agent, route: Route, run: str, headers: dict[str, str]) -> httpx.Response:
    body = route.request_body(run, agent.ssd)
    if isinstance(body, bytes):
        return await agent.http.request(route.method, route.url(run), content=body, headers=headers)
    return await agent.http.request(
        route.method,
        route.url(run),
        json=body,
        params=route.params,
        headers=headers,
    )


async def test_every_route_is_in_the_table(agent: Agent) -> None:
    schema = (await agent.http.get("/openapi.json")).json()
    served = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    known = {(r.method, r.path) for r in ROUTES + UNSCOPED + PEER_PUSH} | OPEN
    unknown = served - known - CONFIGURED
    assert not unknown, f"decide the role of these routes and add them to ROUTES: {unknown}"
    assert known <= served, f"routes in the table the app no longer serves: {known - served}"


async def test_missing_wrong_or_malformed_token_is_401_everywhere(agent: Agent) -> None:
    attempts: list[dict[str, str]] = [
        {},
        bearer("not-a-token"),
        bearer(""),
        {"Authorization": f"Basic {ADMIN}"},
        {"Authorization": ADMIN},
    ]
    for route in ROUTES + UNSCOPED + PEER_PUSH:
        for headers in attempts:
            answer = await call(agent, route, "llama-7b", headers)
            assert answer.status_code == 401, (route, headers, answer.text)
            assert answer.json()["error"]["code"] == "unauthorized"
            assert answer.headers["www-authenticate"] == "Bearer"


async def test_roles_and_run_patterns_are_403_everywhere(agent: Agent) -> None:
    checked = 0
    for route in ROUTES:
        for token, role in ((READER, "reader"), (TRAINER, "trainer"), (ADMIN, "admin")):
            for run in ("llama-7b", "gpt-2"):
                in_pattern = role == "admin" or run.startswith("llama-")
                allowed = in_pattern and ROLE_LEVEL[role] >= route.action
                answer = await call(agent, route, run, bearer(token))
                if allowed:
                    assert answer.status_code not in (401, 403), (route, role, run, answer.text)
                else:
                    assert answer.status_code == 403, (route, role, run, answer.text)
                    error = answer.json()["error"]
                    assert error["code"] == "forbidden" and run in error["message"]
                checked += 1
    assert checked == len(ROUTES) * 6


async def test_peer_token_only_pushes_and_only_it_pushes(agent: Agent) -> None:
    for route in ROUTES + UNSCOPED:
        answer = await call(agent, route, "llama-7b", bearer(PEER))
        if route.path == "/v1/runs":
            assert answer.status_code == 200 and answer.json()["runs"] == []
        else:
            assert answer.status_code == 403, (route, answer.text)
    for route in PEER_PUSH:
        for token in (READER, TRAINER, ADMIN):
            answer = await call(agent, route, "llama-7b", bearer(token))
            assert answer.status_code == 403, (route, token, answer.text)
            assert "only a token of role 'peer'" in answer.json()["error"]["message"]
        # Past auth: the shard does not exist.
        answer = await call(agent, route, "llama-7b", bearer(PEER))
        assert answer.status_code == 404, (route, answer.text)


async def wait_durable(agent: Agent, run: str, step: int, token: str) -> None:
    url = f"/v1/runs/{run}/checkpoints/{step}"
    for _ in range(1200):
        state = (await agent.http.get(url, headers=bearer(token))).json()["state"]
        if state == "durable":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run}/{step} stuck in {state}")


async def test_authorized_calls_work_and_listing_is_filtered(agent: Agent) -> None:
    # The reader sees its own runs only; the admin sees both.
    reader_runs = (await agent.http.get("/v1/runs", headers=bearer(READER))).json()
    assert [r["run"] for r in reader_runs["runs"]] == ["llama-7b"]
    assert reader_runs["total"] == 1
    admin_runs = (await agent.http.get("/v1/runs", headers=bearer(ADMIN))).json()
    assert sorted(r["run"] for r in admin_runs["runs"]) == ["gpt-2", "llama-7b"]

    # A trainer registers within its pattern, and a reader reads it back.
    ckpt = write_checkpoint(agent.ssd / "llama-7b" / "step-2", {"w.bin": b"more"})
    registered = await agent.http.post(
        "/v1/checkpoints",
        json={"run": "llama-7b", "step": 2, "path": str(ckpt)},
        headers=bearer(TRAINER),
    )
    assert registered.status_code == 202, registered.text
    await wait_durable(agent, "llama-7b", 2, READER)
    detail = await agent.http.get("/v1/runs/llama-7b/checkpoints/2", headers=bearer(READER))
    assert detail.status_code == 200 and detail.json()["state"] == "durable"

    # The POSIX object route serves bytes to a reader of that run only.
    await wait_durable(agent, "llama-7b", 1, ADMIN)
    await wait_durable(agent, "gpt-2", 1, ADMIN)
    key = "llama-7b/step-000000000001/rank-00000/w.bin"
    data = await agent.http.get(f"/v1/regions/local/objects/{key}", headers=bearer(READER))
    assert data.status_code == 200 and data.content == b"weights"
    other = "gpt-2/step-000000000001/rank-00000/w.bin"
    denied = await agent.http.get(f"/v1/regions/local/objects/{other}", headers=bearer(READER))
    assert denied.status_code == 403
    allowed = await agent.http.get(f"/v1/regions/local/objects/{other}", headers=bearer(ADMIN))
    assert allowed.status_code == 200 and allowed.content == b"weights"


async def test_probes_and_schema_stay_open(agent: Agent) -> None:
    assert (await agent.http.get("/healthz")).json() == {"status": "ok"}
    ready = await agent.http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert (await agent.http.get("/openapi.json")).status_code == 200


@pytest.mark.parametrize("public", [True, False])
async def test_metrics_public_or_behind_a_token(tmp_path: Path, public: bool) -> None:
    async with running_agent(
        f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
        tmp_path,
        start_worker=False,
        tokens=TOKENS,
        server={"metrics_public": public},
    ) as running:
        anonymous = await running.http.get("/metrics")
        if public:
            assert anonymous.status_code == 200
        else:
            assert anonymous.status_code == 401, anonymous.text
            assert anonymous.json()["error"]["code"] == "unauthorized"
            wrong = await running.http.get("/metrics", headers=bearer("nope"))
            assert wrong.status_code == 401
        # Any token that may read gets the figures (they span runs).
        for token in (READER, TRAINER, ADMIN):
            answer = await running.http.get("/metrics", headers=bearer(token))
            assert answer.status_code == 200, answer.text
            assert answer.headers["content-type"].startswith("text/plain")


async def test_dashboard_pages_need_a_token_and_respect_patterns(agent: Agent) -> None:
    """/ui is outside the OpenAPI schema but behind the same tokens."""
    for headers in ({}, bearer("not-a-token")):
        for page in ("/ui", "/ui/runs/llama-7b"):
            answer = await agent.http.get(page, headers=headers)
            assert answer.status_code == 401, (page, headers)
            assert "gpt-2" not in answer.text  # no run names for strangers
    listing = await agent.http.get("/ui", headers=bearer(READER))
    assert listing.status_code == 200
    assert "llama-7b" in listing.text and "gpt-2" not in listing.text
    assert (await agent.http.get("/ui/runs/llama-7b", headers=bearer(READER))).status_code == 200
    assert (await agent.http.get("/ui/runs/gpt-2", headers=bearer(READER))).status_code == 403
    assert (await agent.http.get("/ui/runs/gpt-2", headers=bearer(ADMIN))).status_code == 200
