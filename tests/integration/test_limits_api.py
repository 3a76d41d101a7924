"""Request limits through HTTP: rate per token (429 + Retry-After), body size
(413), metadata size, files per checkpoint, path length, run-name rules —
each a clear 4xx with the JSON error shape, and nothing recorded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from devsupport.agent import Agent, running_agent, token_entry, write_checkpoint

ALICE, BOB = "alice-token", "bob-token"


def catalog(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_429(answer: httpx.Response) -> int:
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "rate_limited"
    assert "requests per second" in answer.json()["error"]["message"]
    retry_after = int(answer.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


async def test_rate_limit_is_per_token(tmp_path: Path) -> None:
    tokens = [token_entry("alice", ALICE, "admin"), token_entry("bob", BOB, "admin")]
    async with running_agent(
        catalog(tmp_path),
        tmp_path,
        start_worker=False,
        tokens=tokens,
        server={"rate_limit_per_second": 2, "rate_limit_burst": 4},
    ) as agent:
        answers = [await agent.http.get("/v1/runs", headers=bearer(ALICE)) for _ in range(6)]
        assert [a.status_code for a in answers[:4]] == [200] * 4
        assert_429(answers[4])
        # Bob's token has its own bucket; probes are never throttled.
        assert (await agent.http.get("/v1/runs", headers=bearer(BOB))).status_code == 200
        for _ in range(10):
            assert (await agent.http.get("/healthz", headers=bearer(ALICE))).status_code == 200
            assert (await agent.http.get("/readyz")).status_code == 200
        # Unknown tokens are limited by address: guessing gets throttled too.
        guesses = [
            (await agent.http.get("/v1/runs", headers=bearer(f"guess-{i}"))).status_code
            for i in range(6)
        ]
        assert guesses[:4] == [401] * 4 and guesses[4:] == [429, 429]
        # The bucket refills at the configured rate.
        await asyncio.sleep(0.6)
        assert (await agent.http.get("/v1/runs", headers=bearer(ALICE))).status_code == 200


async def test_without_tokens_the_limit_is_per_client_address(tmp_path: Path) -> None:
    async with running_agent(
        catalog(tmp_path),
        tmp_path,
        start_worker=False,
        server={"rate_limit_per_second": 0.5, "rate_limit_burst": 2},
    ) as agent:
        app = agent.http._transport.app  # type: ignore[attr-defined]

        def client_from(address: str) -> httpx.AsyncClient:
            transport = httpx.ASGITransport(app=app, client=(address, 40000))
            return httpx.AsyncClient(transport=transport, base_url="http://agent")

        async with client_from("127.0.0.2") as one, client_from("127.0.0.3") as two:
            first = [(await one.get("/v1/runs")).status_code for _ in range(3)]
            assert first[:2] == [200, 200]
            assert assert_429(await one.get("/v1/runs")) == 2  # 1 token per 2 s
            assert (await two.get("/v1/runs")).status_code == 200


async def test_rate_limit_can_be_turned_off(tmp_path: Path) -> None:
    async with running_agent(
        catalog(tmp_path),
        tmp_path,
        start_worker=False,
        server={"rate_limit_per_second": 0, "rate_limit_burst": 1},
    ) as agent:
        codes = {(await agent.http.get("/v1/runs")).status_code for _ in range(50)}
        assert codes == {200}


async def test_body_size_limit_is_413_declared_or_streamed(tmp_path: Path) -> None:
    async with running_agent(
        catalog(tmp_path), tmp_path, start_worker=False, server={"max_body_bytes": 2048}
    ) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        big = {"run": "r", "step": 1, "path": str(ckpt), "metadata": {"pad": "x" * 4096}}
        declared = await agent.http.post("/v1/checkpoints", json=big)
        assert declared.status_code == 413, declared.text
        assert declared.json()["error"]["code"] == "body_too_large"
        assert "2048" in declared.json()["error"]["message"]

        async def chunks():  # no Content-Length: counted as it streams in
            for _ in range(8):
                yield b" " * 512

        streamed = await agent.http.post(
            "/v1/checkpoints", content=chunks(), headers={"content-type": "application/json"}
        )
        assert streamed.status_code == 413, streamed.text
        assert streamed.json()["error"]["code"] == "body_too_large"
        small = await agent.http.post("/v1/checkpoints", json={**big, "metadata": {}})
        assert small.status_code == 202, small.text


@pytest.mark.parametrize(
    ("run", "why"),
    [
        ("bad run", "space"),
        ("", "empty"),
        ("x" * 129, "too long"),
        ("a/b", "slash"),
        ("ünï", "non-ASCII"),
    ],
)
async def test_run_name_rules(tmp_path: Path, run: str, why: str) -> None:
    async with running_agent(catalog(tmp_path), tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        answer = await agent.register(run, 1, ckpt)
        assert answer.status_code == 422, (why, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "invalid_request" and "run" in error["message"], why
        assert (await agent.http.get("/v1/runs")).json()["total"] == 0
        # 128 characters is still fine.
        assert (await agent.register("x" * 128, 1, ckpt)).status_code == 202


async def test_run_names_in_paths_follow_the_same_rules(tmp_path: Path) -> None:
    """No route can look up, create (PUT retention) or build keys from a run
    name registration would refuse."""
    async with running_agent(catalog(tmp_path), tmp_path, start_worker=False) as agent:
        for run in (
            "bad run",
            "x" * 129,
            "a%2Fb",
            "%2E",
            "%2E%2E",
            "caf%C3%A9",
            "abc%0A",
            "%2E%2E%0A",
        ):
            for method, url, body in (
                ("GET", f"/v1/runs/{run}/latest", None),
                ("GET", f"/v1/runs/{run}/checkpoints/1", None),
                ("PUT", f"/v1/runs/{run}/retention", {"keep_last": 2}),
                ("DELETE", f"/v1/runs/{run}/checkpoints/1", None),
            ):
                answer = await agent.http.request(method, url, json=body)
                # 404: the name does not even route (a slash, a dot segment).
                expected = (422,) if run in ("bad run", "x" * 129) else (404, 422)
                assert answer.status_code in expected, (method, url, answer.text)
                if answer.status_code == 422:
                    assert answer.json()["error"]["code"] == "invalid_run", answer.text
        assert (await agent.http.get("/v1/runs")).json()["total"] == 0
        ok = await agent.http.put(f"/v1/runs/{'x' * 128}/retention", json={"keep_last": 2})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("run", [".", ".."])
async def test_dot_run_names_are_refused(tmp_path: Path, run: str) -> None:
    async with running_agent(catalog(tmp_path), tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        answer = await agent.register(run, 1, ckpt)
        assert answer.status_code == 422, answer.text


async def test_metadata_files_and_path_limits(tmp_path: Path) -> None:
    async with running_agent(
        catalog(tmp_path),
        tmp_path,
        start_worker=False,
        local={"max_files_per_checkpoint": 3, "max_path_length": 160},
    ) as agent:
        assert len(str(agent.ssd)) < 140, "the limits below assume a shortish tmp path"
        ok = write_checkpoint(agent.ssd / "ok", {"a": b"1", "b": b"2", "c": b"3"})
        many = write_checkpoint(agent.ssd / "many", {f"f{i}": b"x" for i in range(4)})
        # A name of 170 bytes (fine for the filesystem, over the limit).
        long_name = write_checkpoint(agent.ssd / "long", {"n" * 170: b"x"})
        # An absolute path just over the limit, whatever the tmp path's length.
        deep = agent.ssd / ("d" * (165 - len(str(agent.ssd))))
        write_checkpoint(deep, {"w": b"x"})

        metadata = {"notes": "x" * (64 * 1024)}
        too_much = await agent.register("r", 1, ok, metadata=metadata)
        assert too_much.status_code == 422
        assert "metadata must serialise to at most 65536 bytes" in too_much.text

        metrics = {f"m{i}": 1.0 for i in range(257)}
        assert (await agent.register("r", 1, ok, metrics=metrics)).status_code == 422
        nan = await agent.http.post(
            "/v1/checkpoints",
            content=f'{{"run": "r", "step": 1, "path": "{ok}", "metrics": {{"l": NaN}}}}',
            headers={"content-type": "application/json"},
        )
        assert nan.status_code == 422 and nan.json()["error"]["code"] == "invalid_request"

        cases = [
            (many, "too_many_files", "more than 3 files"),
            (long_name, "path_too_long", "longer than 160 bytes"),
            (deep, "invalid_path", "too long"),
        ]
        for path, code, message in cases:
            answer = await agent.register("r", 1, path)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == code
            assert message in answer.json()["error"]["message"]

        huge_step = await agent.register("r", 2**63, ok)
        assert huge_step.status_code == 422
        assert (await agent.http.get("/v1/runs")).json()["total"] == 0
        assert (await agent.register("r", 1, ok, metadata={"k": "v"})).status_code == 202


async def test_query_limits(tmp_path: Path) -> None:
    """Query limits: page sizes and out-of-range integers are 4xx, not 500."""
    async with running_agent(catalog(tmp_path), tmp_path, start_worker=False) as agent:
        await _registered(agent)
        for url in (
            "/v1/runs?limit=0",
            "/v1/runs?limit=100000",
            "/v1/runs/r/checkpoints?offset=-1",
            "/v1/runs/r/checkpoints/notanumber",
        ):
            answer = await agent.http.get(url)
            assert answer.status_code == 422, (url, answer.text)
            assert answer.json()["error"]["code"] == "invalid_request"
        for url in (
            "/v1/runs/r/checkpoints/-5",
            f"/v1/runs/r/checkpoints/{2**70}",
            f"/v1/runs/r/checkpoints/{2**70}/lineage",
            f"/v1/runs/r/checkpoints?min_step={2**70}",
        ):
            answer = await agent.http.get(url)
            assert 400 <= answer.status_code < 500, (url, answer.text)
            assert answer.json()["error"]["message"]


async def _registered(agent: Agent) -> None:
    ckpt = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
    assert (await agent.register("r", 1, ckpt)).status_code == 202
