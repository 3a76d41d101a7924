"""Structured logs of a real agent: every line is JSON, requests carry their
request id, job lines carry the job (id, kind, run, step, region)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import AT_COMMIT, RECORDED, posix_region, running_agent, write_checkpoint
from tierckpt.service.observability.logs import make_handler


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = make_handler("json", stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def records(stream: io.StringIO) -> list[dict[str, Any]]:
    # Every line must parse: one JSON object per line, nothing else.
    return [json.loads(line) for line in stream.getvalue().splitlines() if line]


async def test_json_lines_carry_request_id_and_job_context(
    catalog_url: str, tmp_path: Path, json_log: io.StringIO
) -> None:
    west = tmp_path / "west"
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", west)]
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        # West breaks after start: its replicate job fails and retries.
        shutil.rmtree(west)
        west.write_text("not a directory")
        ckpt = write_checkpoint(agent.ssd / "s7", {"w.bin": 2048})
        answer = await agent.http.post(
            "/v1/checkpoints",
            json={"run": "logs", "step": 7, "path": str(ckpt)},
            headers={"X-Request-ID": "req-logs-7"},
        )
        assert answer.status_code == 202
        assert answer.headers["x-request-id"] == "req-logs-7"
        # The agent's own time, to its answer's headers (the log's runs to the last byte).
        timing = answer.headers["server-timing"]
        assert re.fullmatch(r"app;dur=\d+\.\d\d", timing), timing
        await agent.wait_state("logs", 7, ("durable",))
        for _ in range(400):
            found = [r for r in records(json_log) if r.get("job_kind") == "replicate"]
            if found:
                break
            await asyncio.sleep(0.05)

        generated = await agent.http.get("/v1/runs/logs/checkpoints/7")
        assert len(generated.headers["x-request-id"]) == 16  # made up when none was sent
        assert generated.headers["server-timing"].startswith("app;dur=")  # quiet GETs too

    lines = records(json_log)
    assert lines and all({"ts", "level", "logger", "message"} <= set(r) for r in lines)
    access = [r for r in lines if r["logger"] == "tierckpt.http" and r.get("method") == "POST"]
    assert access and access[0]["request_id"] == "req-logs-7"
    assert access[0]["path"] == "/v1/checkpoints" and access[0]["status"] == 202
    assert 0 < float(timing.removeprefix("app;dur=")) <= access[0]["duration_ms"] + 0.01

    retry = next(r for r in lines if r.get("job_kind") == "replicate")
    assert retry["level"] == "warning" and "retrying" in retry["message"]
    assert retry["run"] == "logs" and retry["step"] == 7 and retry["region"] == "west"
    assert isinstance(retry["job_id"], int) and retry["attempt"] >= 1
    assert "request_id" not in retry  # background work belongs to no request


async def test_a_recorded_register_line_says_where_the_time_went(
    catalog_url: str, tmp_path: Path, json_log: io.StringIO
) -> None:
    """Answered from the inbox (the default on SQLite), the write behind it."""
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=RECORDED) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 1024})
        answer = await agent.http.post(
            "/v1/checkpoints",
            json={"run": "recorded", "step": 1, "path": str(ckpt)},
            headers={"X-Request-ID": "req-recorded-1"},
        )
        assert answer.status_code == 202
        exposed = (await agent.http.get("/metrics")).text
    lines = [r for r in records(json_log) if r["logger"] == "tierckpt.http"]
    line = next(r for r in lines if r.get("request_id") == "req-recorded-1")
    phases = {k: v for k, v in line.items() if k.startswith("register_") and k.endswith("_ms")}
    assert set(phases) == {"register_scan_ms", "register_record_ms"}
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= line["duration_ms"]
    assert re.search(r'tierckpt_register_phase_seconds_count{phase="record"} [1-9]', exposed)


async def test_register_line_says_where_the_time_went(
    catalog_url: str, tmp_path: Path, json_log: io.StringIO
) -> None:
    """Answered at the commit: the group commit's phases."""
    async with running_agent(catalog_url, tmp_path, catalog=AT_COMMIT) as agent:
        for step in (1, 2):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": 1024})
            answer = await agent.http.post(
                "/v1/checkpoints",
                json={"run": "phases", "step": step, "path": str(ckpt)},
                headers={"X-Request-ID": f"req-phases-{step}"},
            )
            assert answer.status_code == 202
        exposed = (await agent.http.get("/metrics")).text

    lines = [r for r in records(json_log) if r["logger"] == "tierckpt.http"]
    line = next(r for r in lines if r.get("request_id") == "req-phases-1")
    phases = {k: v for k, v in line.items() if k.startswith("register_") and k.endswith("_ms")}
    expected = {"scan", "queued", "lock", "write", "commit"}
    if catalog_url.startswith("sqlite"):
        # The in-process write gate before SQLite's lock. (The WAL's fsync
        # after the commit is a phase only with register_ack = "on_disk":
        # by default the answer leaves before it.)
        expected |= {"gate"}
    assert {k.removeprefix("register_").removesuffix("_ms") for k in phases} == expected
    if not catalog_url.startswith("sqlite"):
        # The run known, a new checkpoint is one statement in autocommit
        # (checkpoints/fresh_batch.py): its commit is in its write.
        second = next(r for r in lines if r.get("request_id") == "req-phases-2")
        assert "register_write_ms" in second and "register_commit_ms" not in second
    assert all(v >= 0 for v in phases.values()) and line["register_batch"] == 1
    # Inside the request: the phases cannot add up to more than the request took.
    assert sum(phases.values()) <= line["duration_ms"]
    for phase in expected:  # the registry is the process's: earlier tests count too
        counted = re.search(
            rf'tierckpt_register_phase_seconds_count{{phase="{phase}"}} (\S+)', exposed
        )
        assert counted is not None and float(counted.group(1)) >= 1
