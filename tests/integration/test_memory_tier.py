"""The memory tier through the HTTP API, in process, on SQLite and PostgreSQL:
reserve a segment, write it, register it (staged), the agent writes it to T0
and registers it (durable); the detail's copies, the node-scoped `latest`,
backpressure when the arena is full, and the bad inputs."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from devsupport.agent import Agent, running_agent

NODE = "node-test"
FILES = {"model.bin": os.urandom(300_000), "nested/state.json": b'{"step": 1}\n'}


def _sizes(files: dict[str, bytes]) -> list[dict[str, Any]]:
    return [{"path": p, "size": len(data)} for p, data in files.items()]


async def stage(
    agent: Agent, run: str, step: int, files: dict[str, bytes] = FILES, **extra: Any
) -> dict[str, Any]:
    """Reserve, write and register one segment; the staged checkpoint."""
    reserved = await agent.http.post(
        "/v1/memory/segments", json={"run": run, "step": step, "files": _sizes(files)}
    )
    assert reserved.status_code == 201, reserved.text
    segment = reserved.json()
    for relative, data in files.items():
        path = Path(segment["path"]) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    target = agent.ssd / run / f"step-{step}"
    answer = await agent.http.post(
        f"/v1/memory/segments/{segment['id']}/register",
        json={"run": run, "step": step, "path": str(target), **extra},
    )
    assert answer.status_code == 202, answer.text
    return {"segment": segment, "checkpoint": answer.json(), "target": target}


async def test_staged_segment_is_written_to_t0_and_becomes_durable(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        info = (await agent.http.get("/v1/memory")).json()
        assert info["enabled"] and info["bytes"] == 10 << 20 and info["used"] == 0
        staged = await stage(agent, "mem", 1, metrics={"loss": 0.5}, write_seconds=0.01)
        assert staged["checkpoint"]["state"] == "staged"
        assert staged["checkpoint"]["metrics"] == {"loss": 0.5}

        await agent.wait_state("mem", 1)
        target = staged["target"]
        await agent.wait_on_t0(target)
        done = (await agent.http.get("/v1/runs/mem/checkpoints/1")).json()
        for relative, data in FILES.items():
            assert (target / relative).read_bytes() == data
        assert {f["path"] for f in done["files"]} == set(FILES)
        assert done["write_seconds"] == 0.01
        # No hidden staging directory left on T0.
        assert [p.name for p in target.parent.iterdir()] == ["step-1"]
        tiers = {c["tier"] for c in done["copies"]}
        # Kept in memory (keep_newest), on T0, and in the region.
        assert tiers == {"memory", "t0", "region"}, done["copies"]

        # A newer one persisted frees the older segment.
        staged_at = datetime.now(UTC)
        second = await stage(agent, "mem", 2)
        await agent.wait_state("mem", 2)
        await agent.wait_on_t0(second["target"])
        segments = (await agent.http.get("/v1/memory")).json()["segments"]
        assert [(s["step"], s["state"]) for s in segments] == [(2, "persisted")]
        # When T0 held it, on the agent's clock (this machine's).
        persisted_at = datetime.fromisoformat(segments[0]["persisted_at"])
        assert staged_at < persisted_at <= datetime.now(UTC)
        assert not await asyncio.to_thread(os.path.exists, staged["segment"]["path"])


async def test_node_scoped_latest_answers_the_staged_checkpoint(
    catalog_url: str, tmp_path: Path
) -> None:
    # No worker: nothing is persisted, the checkpoint stays staged... but a
    # memory tier needs the worker, so stop the persister instead.
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        await stage(agent, "node", 1)
        await agent.wait_state("node", 1)
        memory = await agent.hold_persister()
        await stage(agent, "node", 2)

        durable = (await agent.http.get("/v1/runs/node/latest", params={"node": NODE})).json()
        assert durable["step"] == 1
        scoped = await agent.http.get(
            "/v1/runs/node/latest", params={"node": NODE, "scope": "node"}
        )
        assert scoped.status_code == 200, scoped.text
        body = scoped.json()
        assert (body["step"], body["state"], body["durable"], body["durable_step"]) == (
            2,
            "staged",
            False,
            1,
        )
        assert body["memory"][0]["rank"] == 0
        assert (Path(body["memory"][0]["path"]) / "model.bin").read_bytes() == FILES["model.bin"]
        # The detail answers a staged checkpoint from the arena.
        detail = (await agent.http.get("/v1/runs/node/checkpoints/2")).json()
        assert detail["state"] == "staged"
        assert [c["tier"] for c in detail["copies"]] == ["memory"]
        # Another node holds nothing newer: it gets the durable one.
        other = (
            await agent.http.get(
                "/v1/runs/node/latest", params={"node": "elsewhere", "scope": "node"}
            )
        ).json()
        assert other["step"] == 1 and other["memory"] == []
        missing = await agent.http.get("/v1/runs/node/latest", params={"scope": "node"})
        assert missing.status_code == 400
        assert "node=" in missing.json()["error"]["message"]

        # The persister back: the staged checkpoint reaches the catalog.
        memory.persister.start()
        memory.persister.wake()
        await agent.wait_state("node", 2)


async def test_full_arena_answers_507_and_frees_space_as_segments_persist(
    catalog_url: str, tmp_path: Path
) -> None:
    big = {"a.bin": os.urandom(600_000)}
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 1_000_000}) as agent:
        memory = await agent.hold_persister()  # nothing leaves memory meanwhile
        await stage(agent, "full", 1, big)
        refused = await agent.http.post(
            "/v1/memory/segments", json={"run": "full", "step": 2, "files": _sizes(big)}
        )
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["code"] == "memory_full"
        too_large = await agent.http.post(
            "/v1/memory/segments",
            json={"run": "full", "step": 2, "files": [{"path": "x", "size": 2_000_000}]},
        )
        assert too_large.status_code == 507
        assert too_large.json()["error"]["code"] == "segment_too_large"

        # Persisted, the segment is a cache: a new reservation evicts it.
        memory.persister.start()
        memory.persister.wake()
        await agent.wait_state("full", 1)
        again = await agent.http.post(
            "/v1/memory/segments", json={"run": "full", "step": 2, "files": _sizes(big)}
        )
        assert again.status_code == 201, again.text
        # Given back (a save that goes to disk after all): its room is the
        # next reservation's.
        released = await agent.http.delete(f"/v1/memory/segments/{again.json()['id']}")
        assert released.status_code == 200
        info = (await agent.http.get("/v1/memory")).json()
        assert info["segments"] == [] and info["used"] == 0
        reused = await agent.http.post(
            "/v1/memory/segments", json={"run": "full", "step": 3, "files": _sizes(big)}
        )
        assert reused.status_code == 201, reused.text


async def test_bad_segments_are_refused_with_a_reason(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        for files, code in (
            ([{"path": "../x", "size": 1}], "invalid_file_name"),
            ([{"path": "/abs", "size": 1}], "invalid_file_name"),
            ([{"path": "a", "size": 1}, {"path": "a", "size": 2}], "invalid_file_name"),
            ([{"path": "a", "size": -1}], "invalid_request"),
            ([{"path": "d", "size": 1}, {"path": "d/b", "size": 1}], "invalid_file_name"),
        ):
            answer = await agent.http.post(
                "/v1/memory/segments", json={"run": "bad", "step": 1, "files": files}
            )
            assert answer.status_code in (400, 422), answer.text
            assert answer.json()["error"]["code"] == code, answer.text

        reserved = (
            await agent.http.post(
                "/v1/memory/segments",
                json={"run": "bad", "step": 1, "files": [{"path": "a", "size": 4}]},
            )
        ).json()
        url = f"/v1/memory/segments/{reserved['id']}/register"
        body = {"run": "bad", "step": 1, "path": str(agent.ssd / "bad" / "step-1")}
        # A file shorter than reserved (the trainer wrote less).
        (Path(reserved["path"]) / "a").write_bytes(b"ab")
        incomplete = await agent.http.post(url, json=body)
        assert incomplete.status_code == 400
        assert incomplete.json()["error"]["code"] == "segment_incomplete"
        (Path(reserved["path"]) / "a").write_bytes(b"abcd")
        outside = await agent.http.post(url, json={**body, "path": str(tmp_path / "elsewhere")})
        assert outside.json()["error"]["code"] == "path_outside_roots"
        wrong_step = await agent.http.post(url, json={**body, "step": 2})
        assert wrong_step.json()["error"]["code"] == "segment_mismatch"
        unknown = await agent.http.post("/v1/memory/segments/nope/register", json=body)
        assert unknown.status_code == 404
        assert (await agent.http.post(url, json=body)).status_code == 202
        # A staged segment is the agent's now: it cannot be given back.
        refused = await agent.http.delete(f"/v1/memory/segments/{reserved['id']}")
        assert refused.status_code == 409
        await agent.wait_state("bad", 1)


async def test_agent_without_memory_tier_says_so(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 0}) as agent:
        assert (await agent.http.get("/v1/memory")).json()["enabled"] is False
        answer = await agent.http.post(
            "/v1/memory/segments", json={"run": "off", "step": 1, "files": _sizes(FILES)}
        )
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "memory_off"


async def test_an_unusable_memory_directory_turns_the_tier_off_not_the_agent(
    catalog_url: str, tmp_path: Path
) -> None:
    taken = tmp_path / "not-a-directory"
    taken.write_bytes(b"")
    async with running_agent(
        catalog_url, tmp_path, memory={"bytes": 10 << 20, "dir": str(taken)}
    ) as agent:
        assert (await agent.http.get("/v1/memory")).json()["enabled"] is False
        assert (await agent.http.get("/healthz")).status_code == 200
        refused = await agent.http.post(
            "/v1/memory/segments", json={"run": "off", "step": 1, "files": _sizes(FILES)}
        )
        assert refused.json()["error"]["code"] == "memory_off"


async def test_restarted_agent_persists_what_an_earlier_life_staged(
    catalog_url: str, tmp_path: Path
) -> None:
    ssd = tmp_path / "ssd"
    async with running_agent(catalog_url, tmp_path, ssd=ssd, memory={"bytes": 10 << 20}) as agent:
        await agent.hold_persister()
        staged = await stage(agent, "again", 5)
        # A half-done attempt of the earlier life: its hidden directory on T0.
        leftover = ssd / "again" / f".tierckpt-persist-{staged['segment']['id']}"
        leftover.mkdir(parents=True)
        (leftover / "model.bin").write_bytes(b"partial")
    async with running_agent(catalog_url, tmp_path, ssd=ssd, memory={"bytes": 10 << 20}) as agent:
        done = await agent.wait_state("again", 5)
        assert done["state"] == "durable"
        await agent.wait_on_t0(ssd / "again" / "step-5")
        assert (ssd / "again" / "step-5" / "model.bin").read_bytes() == FILES["model.bin"]
        assert not leftover.exists()
        await asyncio.sleep(0)


async def test_a_directory_swapped_for_a_symlink_is_not_followed(
    catalog_url: str, tmp_path: Path
) -> None:
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "state.json").write_bytes(b'{"secret": "x"}\n')  # same name and size
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        memory = await agent.hold_persister()
        files = {"nested/state.json": b'{"step": 77}\n'}
        staged = await stage(agent, "swap", 1, files)
        data = Path(staged["segment"]["path"])
        (data / "nested" / "state.json").unlink()
        (data / "nested").rmdir()
        (data / "nested").symlink_to(secret)
        memory.persister.start()
        memory.persister.wake()
        deadline = asyncio.get_running_loop().time() + 30
        while (answer := (await agent.http.get("/v1/runs/swap/checkpoints/1")).json())[
            "state"
        ] == "staged":
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert answer["state"] == "failed", answer
        assert not staged["target"].exists()


async def test_the_upload_reads_memory_while_t0_cannot_be_written_yet(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, memory={"bytes": 10 << 20}) as agent:
        # The run's T0 directory cannot be created (a file is in the way):
        # the copy to T0 keeps failing and is retried.
        blocker = agent.ssd / "blocked"
        blocker.write_bytes(b"")
        staged = await stage(agent, "blocked", 1)
        done = await agent.wait_state("blocked", 1)
        assert {f["path"] for f in done["files"]} == set(FILES)
        memory = (await agent.http.get("/v1/memory")).json()
        assert [s["state"] for s in memory["segments"]] == ["staged"]
        assert not staged["target"].exists()
        # Once T0 can be written, the segment reaches it; the region has the bytes.
        blocker.unlink()
        deadline = asyncio.get_running_loop().time() + 60
        while (await agent.http.get("/v1/memory")).json()["segments"][0]["state"] != "persisted":
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        for relative, data in FILES.items():
            assert (staged["target"] / relative).read_bytes() == data
            region = tmp_path / "region-local" / "blocked" / "step-000000000001" / "rank-00000"
            assert (region / relative).read_bytes() == data
