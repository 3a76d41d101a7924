"""The plain POST routes (plain_post.py) answer exactly as the FastAPI
routes of the same paths. `POST /v1/checkpoints`: the same statuses and
bodies for a new checkpoint, a repeat, another rank, and every refusal (bad
input, conflicts, an invalid body, no token, a forbidden run). A memory-staged
save's reserve and stage: a segment reserved, staged (reserving the next
save's), that one staged, and each refusal (a forbidden run, no token, a
segment too large, unknown or reserved for another step, an invalid body).
The FastAPI routes are reached the same way with a chunked body, which a
plain route hands over; spies tell which of the two answered."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import Agent, running_agent, token_entry, write_checkpoint
from tierckpt.service import plain_post
from tierckpt.service.checkpoints import routes

TRAINER = "trainer-secret"
TOKENS = [token_entry("trainers", TRAINER, "trainer", runs="llama-*")]
AUTH = {"Authorization": f"Bearer {TRAINER}"}

# Fields that differ between two registrations of equal content made at
# different moments (or under different names), left out of the comparison.
MOMENT = ("created_at", "expires_at", "id", "run", "path", "uri")


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
    """Counts the calls of ``module.name`` (an async function), which it wraps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


async def _post(
    agent: Agent,
    body: Any,
    *,
    chunked: bool,
    headers: dict[str, str],
    path: str = "/v1/checkpoints",
) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if chunked:

        async def chunks() -> AsyncIterator[bytes]:
            yield raw

        content: Any = chunks()
    else:
        content = raw
    return await agent.http.post(
        path,
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
    spy = Spy(monkeypatch, routes, "register")  # FastAPI's route calls it
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


async def test_the_memory_routes_answer_as_fastapis_do(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch, plain_post, "_hand_over")  # to FastAPI's routes
    async with running_agent(
        catalog_url, tmp_path, tokens=TOKENS, memory={"bytes": 1 << 20}
    ) as agent:
        answers: dict[bool, list[tuple[int, Any]]] = {}
        for chunked in (False, True):
            run = f"llama-{'route' if chunked else 'fast'}"

            async def post(
                body: Any, path: str, headers: dict[str, str] = AUTH, chunked: bool = chunked
            ) -> Any:
                answer = await _post(agent, body, chunked=chunked, headers=headers, path=path)
                answers[chunked].append((answer.status_code, _comparable(answer.json())))
                return answer

            answers[chunked] = []
            files = [{"path": "model.bin", "size": 100}]
            reserve = "/v1/memory/segments"
            segment = (await post({"run": run, "step": 1, "files": files}, reserve)).json()
            (Path(segment["path"]) / "model.bin").write_bytes(b"m" * 100)
            await post({"run": run, "step": 2, "files": [{"path": "x", "size": 2 << 20}]}, reserve)
            await post({"run": "mistral-1", "step": 1, "files": files}, reserve)  # 403
            await post({"run": run, "step": 3, "files": files}, reserve, headers={})  # 401
            await post({"run": run, "step": 3, "files": []}, reserve)  # invalid: 422
            stage = f"/v1/memory/segments/{segment['id']}/register"
            target = str(agent.ssd / run / "step-1")
            await post({"run": run, "step": 9, "path": target}, stage)  # another step: 400
            await post({"run": run, "step": 1}, stage)  # a field missing: 422
            await post({"run": run, "step": 1, "path": target}, "/v1/memory/segments/nope/register")
            staged = await post(
                {"run": run, "step": 1, "path": target, "reserve_next": True}, stage
            )
            ahead = staged.json()["next_segment"]  # the next save's, reserved with this one
            (Path(ahead["path"]) / "model.bin").write_bytes(b"n" * 100)
            target = str(agent.ssd / run / "step-4")
            await post(
                {"run": run, "step": 4, "path": target},
                f"/v1/memory/segments/{ahead['id']}/register",
            )  # staged as step 4: 202
            if not chunked:
                assert spy.calls == 2  # only the two invalid bodies went FastAPI's way
        assert spy.calls > 2  # the chunked bodies went FastAPI's way
        statuses = [status for status, _ in answers[False]]
        assert statuses == [201, 507, 403, 401, 422, 400, 422, 404, 202, 202]
        assert answers[False] == answers[True]
