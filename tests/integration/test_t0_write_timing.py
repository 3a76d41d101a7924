"""With ``[memory] t0_wait_seconds``, a staged segment is written to T0
once its upload has ended (service/memory/upload_first.py): not while the
upload still has to run (for at most that long), at once when the upload
ends, and at once when a reservation finds the arena full; with 0, the
default, at once. Either way, a T0 copy evicted before it was written is
not written. In process, on SQLite
and PostgreSQL; where the upload must not end, its region is a store that
refuses connections (the upload retries, as it would through an outage)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from devsupport.agent import Agent, running_agent, s3_region
from devsupport.processes import free_port
from tierckpt.service.checkpoints.tables import CHECKPOINTS, RUNS, SHARDS

FILES = {"model.bin": os.urandom(600_000), "state.json": b'{"step": 1}\n'}


async def _stage(agent: Agent, run: str, step: int) -> Path:
    """Reserve, write and stage one segment; its T0 directory."""
    files = [{"path": p, "size": len(d)} for p, d in FILES.items()]
    reserved = await agent.http.post(
        "/v1/memory/segments", json={"run": run, "step": step, "files": files}
    )
    assert reserved.status_code == 201, reserved.text
    segment: dict[str, Any] = reserved.json()
    for relative, data in FILES.items():
        (Path(segment["path"]) / relative).write_bytes(data)
    target = agent.ssd / run / f"step-{step}"
    staged = await agent.http.post(
        f"/v1/memory/segments/{segment['id']}/register",
        json={"run": run, "step": step, "path": str(target)},
    )
    assert staged.status_code == 202, staged.text
    return target


def _down() -> dict[str, Any]:
    """Agent arguments: its only region a store nobody listens for, each
    request tried once and the upload's job retried all along the test (and
    not waited for at the agent's exit)."""
    region = s3_region("down", f"http://127.0.0.1:{free_port()}", "bucket")
    return {
        "regions": [{**region, "request_attempts": 1}],
        "worker": {"max_attempts": 1000, "shutdown_timeout": 0.5},
    }


def _holds(target: Path) -> bool:
    return all((target / p).is_file() and (target / p).read_bytes() == d for p, d in FILES.items())


async def test_the_t0_write_waits_for_the_upload_until_its_wait_is_over(
    catalog_url: str, tmp_path: Path
) -> None:
    memory = {"bytes": 10 << 20, "t0_wait_seconds": 3}
    async with running_agent(catalog_url, tmp_path, memory=memory, **_down()) as agent:
        began = time.monotonic()
        target = await _stage(agent, "held", 1)
        await agent.wait_state("held", 1, ("registered", "uploading"))
        await asyncio.sleep(0.5)
        # Registered (its upload started), not on T0: the upload has not ended.
        assert not target.exists()
        await agent.wait_on_t0(target)
        assert time.monotonic() - began >= 3
        assert await asyncio.to_thread(_holds, target)


async def test_the_t0_write_follows_the_end_of_the_upload(catalog_url: str, tmp_path: Path) -> None:
    memory = {"bytes": 10 << 20, "t0_wait_seconds": 600}
    async with running_agent(catalog_url, tmp_path, memory=memory) as agent:
        target = await _stage(agent, "follows", 1)
        await agent.wait_state("follows", 1)
        # Far sooner than the wait: the upload's end sent it.
        await agent.wait_on_t0(target, timeout=20)
        assert await asyncio.to_thread(_holds, target)


async def test_by_default_t0_is_written_at_once_during_the_upload(
    catalog_url: str, tmp_path: Path
) -> None:
    memory = {"bytes": 10 << 20}  # t0_wait_seconds = 0
    async with running_agent(catalog_url, tmp_path, memory=memory, **_down()) as agent:
        target = await _stage(agent, "at-once", 1)
        await agent.wait_on_t0(target, timeout=20)
        state = (await agent.http.get("/v1/runs/at-once/checkpoints/1")).json()["state"]
        assert state in ("registered", "uploading")


async def test_a_full_arena_sends_what_waits_to_t0_at_once(
    catalog_url: str, tmp_path: Path
) -> None:
    memory = {"bytes": 1_000_000, "t0_wait_seconds": 600}
    async with running_agent(catalog_url, tmp_path, memory=memory, **_down()) as agent:
        first = await _stage(agent, "full", 1)
        await agent.wait_state("full", 1, ("registered", "uploading"))
        files = [{"path": p, "size": len(d)} for p, d in FILES.items()]
        body = {"run": "full", "step": 2, "files": files}
        refused = await agent.http.post("/v1/memory/segments", json=body)
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["code"] == "memory_full"
        # The refusal sent step 1 to T0 without waiting for its upload ...
        await agent.wait_on_t0(first, timeout=20)
        assert await asyncio.to_thread(_holds, first)
        # ... which frees its room for the save that waits.
        assert (await agent.http.post("/v1/memory/segments", json=body)).status_code == 201


@pytest.mark.parametrize("wait", [600, 0])
async def test_a_copy_evicted_before_it_reached_t0_is_not_written(
    catalog_url: str, tmp_path: Path, wait: int
) -> None:
    """`[local] keep_last = 0`: a durable checkpoint's T0 copy is evicted at
    once. Here the persister's loop is held until that eviction, which found
    nothing to delete, has been recorded; then it must not write a T0 copy
    that no eviction would ever remove again, and it frees the segment:
    waiting, it reads the mark before the write; not waiting (0), it writes,
    reads the mark after, and removes the copy again."""
    memory = {"bytes": 10 << 20, "t0_wait_seconds": wait}
    async with running_agent(catalog_url, tmp_path, memory=memory, local={"keep_last": 0}) as agent:
        tier = await agent.hold_persister()
        target = await _stage(agent, "evicted", 1)
        [segment] = tier.arena.staged()
        await tier.persister.register(segment)  # what its loop does first
        await agent.wait_state("evicted", 1)
        deadline = time.monotonic() + 30
        while not await _evicted(agent, "evicted", 1):
            assert time.monotonic() < deadline, "the T0 copy was never evicted"
            await asyncio.sleep(0.05)
        tier.persister.start()
        tier.persister.wake()
        while tier.arena.segments:
            assert time.monotonic() < deadline, "the segment was never freed"
            await asyncio.sleep(0.05)
        assert not target.exists()
        assert not list(agent.ssd.rglob(".tierckpt-persist-*"))  # nor a half-written one


async def _evicted(agent: Agent, run: str, step: int) -> bool:
    async with agent.resources.engine.connect() as connection:
        found = await connection.execute(
            select(SHARDS.c.evicted_at)
            .join(CHECKPOINTS, CHECKPOINTS.c.id == SHARDS.c.checkpoint_id)
            .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
            .where(RUNS.c.name == run, CHECKPOINTS.c.step == step)
        )
        return found.scalar_one() is not None
