"""`tierckpt advise` and the clients' `advice` method against a scripted API."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tierckpt.client import AsyncCheckpointClient, CheckpointClient, cli

BASE_URL = "http://api.test"

ANSWER: dict[str, Any] = {
    "run": "gpt",
    "mtbf_hours": 12.0,
    "restart_seconds": 0.0,
    "window": 50,
    "observed": {
        "checkpoints": 6,
        "write_seconds": {"median_seconds": 300.0, "samples": 6},
        "upload_seconds": {"median_seconds": None, "samples": 0},
        "interval_seconds": {"median_seconds": 3900.0, "samples": 5},
        "compute_seconds": {"median_seconds": 3600.0, "samples": 5},
        "steps_per_second": 0.5,
    },
    "scenarios": [
        {
            "basis": "write",
            "description": "the trainer stalls only for the local write",
            "cost_seconds": 300.0,
            "young": {
                "interval_seconds": 5091.17,
                "interval_hours": 1.4142,
                "every_steps": 2546,
                "waste_fraction": 0.1133,
            },
            "daly": {
                "interval_seconds": 4893.13,
                "interval_hours": 1.3592,
                "every_steps": 2447,
                "waste_fraction": 0.1132,
            },
            "current": None,
        }
    ],
}


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/runs/gpt/advice":
            return httpx.Response(200, json=ANSWER)
        return httpx.Response(
            404, json={"error": {"code": "run_not_found", "message": "run 'x' has no checkpoints"}}
        )

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(
        cli, "_client", lambda args: CheckpointClient(BASE_URL, transport=transport)
    )
    monkeypatch.setenv("COLUMNS", "200")
    return seen


def test_advise_json(requests: list[httpx.Request], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["advise", "gpt", "--mtbf-hours", "12", "--cost-seconds", "300", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["scenarios"][0]["young"]["interval_hours"] == 1.4142
    params = dict(requests[0].url.params)
    assert params == {"mtbf_hours": "12.0", "cost_seconds": "300.0"}


def test_advise_table(requests: list[httpx.Request], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["advise", "gpt", "--mtbf-hours", "12", "--restart-seconds", "60"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "1.41 h, 2546 steps" in out and "1.36 h" in out and "lost 11.33%" in out
    assert "write" in out and "5.0 min" in out
    assert dict(requests[0].url.params)["restart_seconds"] == "60.0"


@pytest.mark.parametrize(
    "argv",
    [
        ["advise", "gpt"],
        ["advise", "gpt", "--mtbf-hours", "0"],
        ["advise", "gpt", "--mtbf-hours", "-1"],
        ["advise", "gpt", "--mtbf-hours", "inf"],
        ["advise", "gpt", "--mtbf-hours", "12", "--cost-seconds", "nothing"],
    ],
)
def test_advise_bad_usage(
    argv: list[str], requests: list[httpx.Request], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert not requests


def test_advise_unknown_run_exits_1(
    requests: list[httpx.Request], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["advise", "x", "--mtbf-hours", "12"]) == 1
    assert "has no checkpoints" in capsys.readouterr().err


async def test_async_client_advice() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=ANSWER))
    async with AsyncCheckpointClient(BASE_URL, transport=transport) as client:
        advice = await client.advice("gpt", 12, window=10)
    assert advice.scenarios[0].daly.every_steps == 2447
    assert advice.observed.upload_seconds.median_seconds is None
