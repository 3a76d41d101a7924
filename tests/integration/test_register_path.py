"""`POST /v1/checkpoints` below FastAPI's routing (checkpoints/register_path.py)
answers exactly as the FastAPI route: the same statuses and bodies for a new
checkpoint, a repeat, another rank, and every refusal (bad input, conflicts,
an invalid body, no token, a forbidden run). The route is reached the same
way with a chunked body, which the fast path hands over; a spy on the
route's endpoint tells which of the two answered."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import Agent, running_agent, token_entry, write_checkpoint
from tierckpt.service.checkpoints import routes

TRAINER = "trainer-secret"
TOKENS = [token_entry("trainers", TRAINER, "trainer", runs="llama-*")]
AUTH = {"Authorization": f"Bearer {TRAINER}"}

# Fields that differ between two registrations of equal content made at
# different moments (or under different names), left out of the comparison.
MOMENT = ("created_at", "id", "run", "path", "uri")


def _comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in MOMENT}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, str) and "/" in value:
        return "<path>"
    if isinstance(value, str):
        return value.replace("llama-fast", "<run>").replace("llama-route", "<run>")
    return value


class Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = routes.register

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(routes, "register", counted)


async def _post(agent: Agent, body: Any, *, chunked: bool, headers: dict[str, str]) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if chunked:

        async def chunks() -> AsyncIterator[bytes]:
            yield raw

        content: Any = chunks()
    else:
        content = raw
    return await agent.http.post(
        "/v1/checkpoints",
        content=content,
        headers={"content-type": "application/json", **headers},
    )


@pytest.fixture
async def agent(catalog_url: str, tmp_path: Path) -> AsyncIterator[Agent]:
    async with running_agent(catalog_url, tmp_path, start_worker=False, tokens=TOKENS) as running:
        yield running


async def test_the_fast_path_answers_as_the_route_does(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch)
    answers: dict[bool, list[tuple[int, Any]]] = {}
    for chunked in (False, True):
        run = f"llama-{'route' if chunked else 'fast'}"
        one = write_checkpoint(agent.ssd / run / "s1", {"model.bin": 1000, "opt.bin": 10})
        other = write_checkpoint(agent.ssd / run / "other", {"model.bin": 2000})
        calls = [
            ({"run": run, "step": 1, "path": str(one)}, AUTH),  # new: 202
            ({"run": run, "step": 1, "path": str(one)}, AUTH),  # a repeat: 200
            ({"run": run, "step": 1, "path": str(other)}, AUTH),  # other content: 409
            ({"run": run, "step": 2, "path": str(one), "rank": 1, "world_size": 2}, AUTH),
            ({"run": run, "step": 2, "path": str(other), "world_size": 3}, AUTH),  # 409
            ({"run": run, "step": 3, "path": str(agent.ssd / "nothing")}, AUTH),  # 400
            ({"run": run, "step": 3, "path": "/etc"}, AUTH),  # outside the roots: 400
            ({"run": run, "step": -1, "path": str(one)}, AUTH),  # invalid: 422
            ({"run": run, "path": str(one)}, AUTH),  # a field missing: 422
            (b'{"run": "x", "step": 1, ', AUTH),  # not JSON: 422
            ({"run": "mistral-1", "step": 1, "path": str(one)}, AUTH),  # forbidden: 403
            ({"run": run, "step": 4, "path": str(one)}, {}),  # no token: 401
        ]
        answers[chunked] = []
        for body, headers in calls:
            answer = await _post(agent, body, chunked=chunked, headers=headers)
            answers[chunked].append((answer.status_code, _comparable(answer.json())))
        if not chunked:
            # Valid bodies never reached FastAPI's route; the invalid ones
            # (handed over for its 422) did not call register there either.
            assert spy.calls == 0
    assert spy.calls > 0  # the chunked bodies went FastAPI's way
    statuses = [status for status, _ in answers[False]]
    assert statuses == [202, 200, 409, 202, 409, 400, 400, 422, 422, 422, 403, 401]
    assert answers[False] == answers[True]


async def test_the_fast_path_keeps_the_request_metrics_and_headers(agent: Agent) -> None:
    one = write_checkpoint(agent.ssd / "m" / "s1", {"model.bin": 100})
    answer = await agent.http.post(
        "/v1/checkpoints",
        json={"run": "llama-m", "step": 1, "path": str(one)},
        headers={**AUTH, "x-request-id": "reg-fast-1"},
    )
    assert answer.status_code == 202, answer.text
    assert answer.headers["x-request-id"] == "reg-fast-1"
    assert answer.headers["server-timing"].startswith("app;dur=")
    assert answer.headers["content-type"] == "application/json"
    metrics = await agent.http.get("/metrics", headers=AUTH)
    labelled = [
        line
        for line in metrics.text.splitlines()
        if 'route="/v1/checkpoints"' in line and 'method="POST"' in line
    ]
    assert labelled, "the registration is counted under its route template"


async def test_a_body_over_the_limit_is_refused_before_the_fast_path(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(
        catalog_url, tmp_path, start_worker=False, server={"max_body_bytes": 1024}
    ) as small:
        one = write_checkpoint(small.ssd / "s1", {"model.bin": 100})
        body = {"run": "r", "step": 1, "path": str(one), "metrics": {"x" * 2000: 1.0}}
        answer = await small.http.post("/v1/checkpoints", json=body)
        assert answer.status_code == 413, answer.text
        assert httpx.codes.is_success(
            (await small.http.post("/v1/checkpoints", json={**body, "metrics": {}})).status_code
        )
