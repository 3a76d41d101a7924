"""`GET /v1/runs/{run}/advice` on a real catalog (SQLite and PostgreSQL):
costs observed from registered and uploaded checkpoints, the override, and
the error answers."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
from datetime import datetime
from pathlib import Path

import pytest

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.client import AsyncCheckpointClient

HOUR = 3600.0


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def test_advice_from_observed_write_and_upload_times(
    catalog_url: str, tmp_path: Path
) -> None:
    writes = [0.5, 0.7, 0.6, 0.6]
    async with running_agent(catalog_url, tmp_path) as agent:
        for number, write in enumerate(writes, start=1):
            ckpt = write_checkpoint(agent.ssd / "adv" / f"step-{number}", {"w.bin": 4096})
            answer = await agent.register("adv", number * 10, ckpt, write_seconds=write)
            assert answer.status_code == 202, answer.text
            await asyncio.sleep(0.25)
        details = [await agent.wait_state("adv", n * 10) for n in range(1, len(writes) + 1)]

        answer = await agent.http.get("/v1/runs/adv/advice", params={"mtbf_hours": 12})
        assert answer.status_code == 200, answer.text
        advice = answer.json()
        observed = advice["observed"]
        assert observed["checkpoints"] == 4
        assert observed["write_seconds"] == {"median_seconds": 0.6, "samples": 4}
        uploads = [(_at(d["durable_at"]) - _at(d["created_at"])).total_seconds() for d in details]
        assert observed["upload_seconds"]["samples"] == 4
        assert observed["upload_seconds"]["median_seconds"] == pytest.approx(
            statistics.median(uploads), abs=0.002
        )
        gaps = [
            (_at(b["created_at"]) - _at(a["created_at"])).total_seconds()
            for a, b in itertools.pairwise(details)
        ]
        assert observed["interval_seconds"]["samples"] == 3
        assert observed["interval_seconds"]["median_seconds"] == pytest.approx(
            statistics.median(gaps), abs=0.002
        )
        assert observed["steps_per_second"] > 0

        by_basis = {s["basis"]: s for s in advice["scenarios"]}
        assert set(by_basis) == {"write", "upload"}
        write = by_basis["write"]
        assert write["cost_seconds"] == 0.6
        assert write["young"]["interval_seconds"] == pytest.approx(math.sqrt(2 * 0.6 * 12 * HOUR))
        assert write["daly"]["interval_seconds"] < write["young"]["interval_seconds"]
        assert 0 < write["young"]["waste_fraction"] < 1
        # The run checkpoints every ~0.25 s: far too often for a 12 h MTBF.
        assert write["current"]["waste_fraction"] > write["young"]["waste_fraction"]
        assert write["young"]["every_steps"] > 10

        # The same through the Python client.
        async with AsyncCheckpointClient("http://agent", transport=agent.http._transport) as client:
            typed = await client.advice("adv", 12, restart_seconds=60)
        assert typed.restart_seconds == 60
        assert typed.scenarios[0].young.interval_seconds == pytest.approx(
            write["young"]["interval_seconds"]
        )
        assert typed.scenarios[0].young.waste_fraction > write["young"]["waste_fraction"]


async def test_advice_override_errors_and_validation(catalog_url: str, tmp_path: Path) -> None:
    # No worker: what is registered never becomes durable (no upload sample).
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        missing = await agent.http.get("/v1/runs/nope/advice", params={"mtbf_hours": 12})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "run_not_found"

        planned = await agent.http.get(
            "/v1/runs/nope/advice", params={"mtbf_hours": 12, "cost_seconds": 300}
        )
        assert planned.status_code == 200, planned.text
        (override,) = planned.json()["scenarios"]
        assert override["basis"] == "override"
        assert override["young"]["interval_hours"] == pytest.approx(1.41421, abs=1e-5)
        assert override["daly"]["interval_seconds"] == pytest.approx(4893.133, abs=1e-3)

        ckpt = write_checkpoint(agent.ssd / "quiet" / "step-1", {"w.bin": 100})
        assert (await agent.register("quiet", 1, ckpt)).status_code == 202
        unobserved = await agent.http.get("/v1/runs/quiet/advice", params={"mtbf_hours": 12})
        assert unobserved.status_code == 409
        error = unobserved.json()["error"]
        assert error["code"] == "no_observations" and "cost_seconds" in error["message"]

        for params in (
            {},
            {"mtbf_hours": 0},
            {"mtbf_hours": -3},
            {"mtbf_hours": "soon"},
            {"mtbf_hours": 12, "cost_seconds": 0},
            {"mtbf_hours": 12, "restart_seconds": -1},
            {"mtbf_hours": 12, "window": 1},
        ):
            bad = await agent.http.get("/v1/runs/quiet/advice", params=params)
            assert bad.status_code == 422, (params, bad.text)
            assert bad.json()["error"]["code"] == "invalid_request"
