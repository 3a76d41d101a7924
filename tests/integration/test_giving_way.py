"""The worker's transactions that give the SQLite write lock up to a waiting
registration (write_gate.give_way_if_asked, db.transaction_giving_way) are
rolled back part-way and run again: the real upload, fan-out, commit and
replicate jobs still leave exactly what they leave when nothing interrupts
them.

The agent's flag is stood in for by one that reads as raised at every third
look, so the jobs' transactions give way at varying statements, several times
each, before they run to the end."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from devsupport.agent import AT_COMMIT, running_agent, write_checkpoint
from devsupport.seaweed import SeaweedServer
from tests.integration.test_regions import key as object_key
from tests.integration.test_regions import remote_sha256, two_regions, west_bucket  # noqa: F401
from tests.integration.test_worker_process import _value
from tierckpt.service import db, write_gate
from tierckpt.service.observability import metrics


class _EveryThirdLook:
    """A flag raised at every third look (the driver looks before each
    statement of a transaction that may give way)."""

    def __init__(self) -> None:
        self.looks = 0

    def raised(self) -> bool:
        self.looks += 1
        return self.looks % 3 == 0


GAVE_WAY = "tierckpt_catalog_gave_way_total"


def _gave_way() -> float:
    """This process's count (the in-process worker's)."""
    return _value(generate_latest(metrics.REGISTRY).decode(), GAVE_WAY)


@pytest.mark.parametrize("fan_out", [True, False], ids=["fan-out", "replicate"])
async def test_jobs_rolled_back_part_way_and_run_again_leave_the_same_result(
    fan_out: bool,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
    seaweed_west: SeaweedServer,
    west_bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SQLite only: PostgreSQL locks rows, not the database; nothing gives way.
    catalog_url = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    flag = _EveryThirdLook()
    monkeypatch.setitem(write_gate._URGENT, "yield", flag)
    monkeypatch.setattr(write_gate, "YIELD_MAX", 0.001)
    monkeypatch.setattr(db, "GIVE_WAY_MAX", 4)
    before = _gave_way()
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket)
    async with running_agent(catalog_url, tmp_path, regions, upload={"fan_out": fan_out}) as agent:
        contents = {"big.bin": 6 << 20, "a/small": b"s", "empty": b""}
        for step in (1, 2):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", contents)
            assert (await agent.register("llm", step, ckpt)).status_code == 202
        for step in (1, 2):
            done = await agent.wait_state("llm", step, states=("replicated",))
            assert [(r["region"], r["state"]) for r in done["replicas"]] == [
                ("east", "committed"),
                ("west", "committed"),
            ]
            # Each job once, each succeeded: a rolled-back claim, fan-out or
            # commit left no second job and no job behind.
            jobs = sorted(
                (j["kind"], j["region"], j["state"])
                for j in done["jobs"]
                if j["kind"] in ("upload", "commit")
            )
            if fan_out:
                assert jobs == [
                    ("commit", "east", "succeeded"),
                    ("commit", "west", "succeeded"),
                    ("upload", "east", "succeeded"),
                    ("upload", "west", "succeeded"),
                ]
            else:
                assert jobs == [("commit", "east", "succeeded"), ("upload", "east", "succeeded")]
                replicate = [
                    (j["region"], j["state"]) for j in done["jobs"] if j["kind"] == "replicate"
                ]
                assert replicate == [("west", "succeeded")]
            for entry in done["files"]:
                digest = remote_sha256(s3_client, s3_bucket, object_key("llm", step, entry["path"]))
                assert digest == entry["sha256"]
        latest = (await agent.http.get("/v1/runs/llm/latest")).json()
        assert latest["step"] == 2
    assert flag.looks > 0
    assert _gave_way() - before >= 8  # the jobs' transactions did give way


async def test_the_worker_process_gives_way_to_a_stream_of_registrations(tmp_path: Path) -> None:
    """Real processes, the real flag: registrations one after another while
    the worker process uploads and commits the earlier ones (SQLite, worker
    in its own process, as under `tierckpt serve`). Its transactions give
    way (the counter it reports through the agent's /metrics rises) and
    every checkpoint still becomes durable with its bytes."""
    catalog_url = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    count = 150
    worker = {"separate_process": "yes"}
    # Answered at the commit: each registration's transaction is in the
    # stream the worker gives way to (an inbox record is written behind its
    # answer, by the same writer, but the client no longer paces the stream).
    async with running_agent(
        catalog_url, tmp_path, worker_process=True, worker=worker, catalog=AT_COMMIT
    ) as agent:
        before = _value((await agent.http.get("/metrics")).text, GAVE_WAY)
        for step in range(1, count + 1):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"model.bin": step.to_bytes(4, "big")})
            assert (await agent.register("stream", step, ckpt)).status_code == 202
            if step == 10:
                # The rest while the worker uploads and commits these.
                await agent.wait_state("stream", 1, timeout=120)
        for step in range(1, count + 1):
            done = await agent.wait_state("stream", step, timeout=120)
            assert [f["sha256"] for f in done["files"]] == [
                hashlib.sha256(step.to_bytes(4, "big")).hexdigest()
            ]
        assert (await agent.http.get("/v1/runs/stream/latest")).json()["step"] == count
        # The worker process reports its counters about once a second.
        for _ in range(100):
            gave_way = _value((await agent.http.get("/metrics")).text, GAVE_WAY)
            if gave_way > before:
                break
            await asyncio.sleep(0.1)
        assert gave_way > before
