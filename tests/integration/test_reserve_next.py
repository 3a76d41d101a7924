"""A memory-staged save in one call: staging a segment with ``reserve_next``
reserves the run's next one (same files, no step yet), which that save writes
and stages under its own step without a reservation call. In process, on
SQLite and PostgreSQL: the step bound at staging (and read back by a
restarted agent), a retried stage answered with the same reservation, no
room meaning none (never a checkpoint's copy evicted for it), and the
refusals a reservation's own check would have made."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from devsupport.agent import Agent, running_agent

FILES = {"model.bin": os.urandom(200_000), "state.json": b'{"step": 1}\n'}


def _sizes(files: dict[str, bytes]) -> list[dict[str, Any]]:
    return [{"path": p, "size": len(data)} for p, data in files.items()]


def _write(segment: dict[str, Any], files: dict[str, bytes]) -> None:
    for relative, data in files.items():
        (Path(segment["path"]) / relative).write_bytes(data)


async def _stage(agent: Agent, segment: dict[str, Any], run: str, step: int, **extra: Any) -> Any:
    return await agent.http.post(
        f"/v1/memory/segments/{segment['id']}/register",
        json={"run": run, "step": step, "path": str(agent.ssd / run / f"step-{step}"), **extra},
    )


async def _reserve(agent: Agent, run: str, step: int, files: dict[str, bytes]) -> dict[str, Any]:
    answer = await agent.http.post(
        "/v1/memory/segments", json={"run": run, "step": step, "files": _sizes(files)}
    )
    assert answer.status_code == 201, answer.text
    segment: dict[str, Any] = answer.json()
    return segment


async def _first_save(
    agent: Agent, run: str, files: dict[str, bytes], step: int = 1
) -> dict[str, Any]:
    """A save reserved, written and staged with ``reserve_next``: the
    segment reserved ahead (asserted there)."""
    first = await _reserve(agent, run, step, files)
    _write(first, files)
    staged = await _stage(agent, first, run, step, reserve_next=True)
    assert staged.status_code == 202, staged.text
    ahead: dict[str, Any] = staged.json()["next_segment"]
    assert ahead is not None
    return ahead


async def _segments(agent: Agent) -> list[tuple[int | None, str]]:
    info = (await agent.http.get("/v1/memory")).json()
    return sorted(((s["step"], s["state"]) for s in info["segments"]), key=str)


async def test_the_next_save_stages_into_the_segment_reserved_with_the_last(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        assert (await agent.http.get("/v1/memory")).json()["reserve_next"] is True
        ahead = await _first_save(agent, "ahead", FILES, step=100)
        assert ahead["bytes"] == sum(map(len, FILES.values()))
        assert sorted(await asyncio.to_thread(os.listdir, ahead["path"])) == sorted(FILES)
        assert (None, "reserved") in await _segments(agent)

        # The next save comes at another step than anyone could have guessed.
        # Its small file is longer: the agent takes the sizes written.
        second = {"model.bin": os.urandom(200_000), "state.json": b'{"step": 250, "loss": 0.5}\n'}
        _write(ahead, second)
        again = await _stage(agent, ahead, "ahead", 250, reserve_next=True)
        assert again.status_code == 202, again.text
        assert again.json()["step"] == 250 and again.json()["state"] == "staged"
        assert again.json()["next_segment"]["id"] != ahead["id"]

        done = await agent.wait_state("ahead", 250)
        target = agent.ssd / "ahead" / "step-250"
        await agent.wait_on_t0(target)
        for relative, data in second.items():
            assert (target / relative).read_bytes() == data
        assert {f["path"]: f["size"] for f in done["files"]} == {
            p: len(d) for p, d in second.items()
        }
        steps = [s for s, _ in await _segments(agent)]
        assert 250 in steps and None in steps


async def test_a_retried_stage_gets_the_same_reservation_and_a_restart_keeps_the_step(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        await agent.hold_persister()  # nothing leaves memory meanwhile
        first = await _reserve(agent, "retry", 1, FILES)
        _write(first, FILES)
        answers = [await _stage(agent, first, "retry", 1, reserve_next=True) for _ in range(2)]
        assert [a.status_code for a in answers] == [202, 202]
        ids = {a.json()["next_segment"]["id"] for a in answers}
        assert len(ids) == 1  # one reservation ahead, not one per attempt
        ahead = answers[0].json()["next_segment"]
        _write(ahead, FILES)
        assert (await _stage(agent, ahead, "retry", 2)).status_code == 202
    # A new life of the agent (the same arena) reads the bound step back from
    # the segment and persists both.
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        for step in (1, 2):
            assert (await agent.wait_state("retry", step))["state"] == "durable"
        await agent.wait_on_t0(agent.ssd / "retry" / "step-2")
        assert (agent.ssd / "retry" / "step-2" / "model.bin").read_bytes() == FILES["model.bin"]


async def test_no_room_means_no_reservation_ahead_and_no_copy_evicted(
    catalog_url: str, tmp_path: Path
) -> None:
    big, small = {"a.bin": os.urandom(600_000)}, {"b.bin": os.urandom(300_000)}
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 1_000_000}) as agent:
        kept = await _reserve(agent, "kept", 1, big)
        _write(kept, big)
        assert (await _stage(agent, kept, "kept", 1)).status_code == 202
        await agent.wait_state("kept", 1)
        await agent.wait_on_t0(agent.ssd / "kept" / "step-1")  # kept in memory as the newest
        segment = await _reserve(agent, "small", 1, small)
        _write(segment, small)
        staged = await _stage(agent, segment, "small", 1, reserve_next=True)
        assert staged.status_code == 202, staged.text
        # Room for it only by evicting the other run's copy: none reserved.
        assert staged.json()["next_segment"] is None
        info = (await agent.http.get("/v1/memory")).json()
        assert ("kept", 1, "persisted") in [
            (g["run"], g["step"], g["state"]) for g in info["segments"]
        ]
        # A save's own reservation still may evict it, as before.
        assert (await _reserve(agent, "small", 2, small))["bytes"] == 300_000


async def test_a_segment_reserved_ahead_is_refused_as_a_reservation_would_be(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        await agent.hold_persister()
        ahead = await _first_save(agent, "refuse", FILES)
        _write(ahead, FILES)
        other_run = await _stage(agent, ahead, "elsewhere", 2)
        assert other_run.status_code == 400
        assert other_run.json()["error"]["code"] == "segment_mismatch"
        assert "its next save" in other_run.json()["error"]["message"]
        taken = await _stage(agent, ahead, "refuse", 1)  # step 1 is staged already
        assert taken.status_code == 409
        assert taken.json()["error"]["code"] == "segment_exists"
        # Refused, it is still the run's next segment, with no step yet.
        assert (None, "reserved") in await _segments(agent)
        assert (await _stage(agent, ahead, "refuse", 2)).status_code == 202


async def test_files_grown_past_the_budget_are_refused_and_the_segment_stays_reserved(
    catalog_url: str, tmp_path: Path
) -> None:
    small = {"a.bin": os.urandom(300_000)}
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 1_000_000}) as agent:
        await agent.hold_persister()
        ahead = await _first_save(agent, "grow", small)
        _write(ahead, {"a.bin": os.urandom(800_000)})  # 300 000 staged + 800 000 > 1 000 000
        refused = await _stage(agent, ahead, "grow", 2)
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["code"] == "memory_full"
        assert (None, "reserved") in await _segments(agent)
        _write(ahead, {"a.bin": os.urandom(350_000)})  # 650 000: fits
        assert (await _stage(agent, ahead, "grow", 2)).status_code == 202
