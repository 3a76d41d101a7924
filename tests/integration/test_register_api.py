"""Register -> background upload -> latest -> restore, through the HTTP API,
on SQLite and PostgreSQL, with a POSIX region (S3 has its own module)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.client import AsyncCheckpointClient


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_register_uploads_commits_and_restores(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        ckpt = write_checkpoint(
            agent.ssd / "run-a" / "step-10",
            {
                "model.bin": 12 << 20,
                "nested/deeper/opt.bin": 3000,
                "empty": b"",
                "naïve-é.txt": b"x",
            },
        )
        answer = await agent.register("run-a", 10, ckpt, metrics={"loss": 0.5})
        assert answer.status_code == 202, answer.text
        assert answer.json()["state"] in ("registered", "uploading")

        done = await agent.wait_state("run-a", 10)
        assert done["state"] == "durable"
        by_path = {f["path"]: f for f in done["files"]}
        assert set(by_path) == {"model.bin", "nested/deeper/opt.bin", "empty", "naïve-é.txt"}
        for relative, entry in by_path.items():
            assert entry["sha256"] == sha256_of(ckpt / relative)
            assert entry["size"] == (ckpt / relative).stat().st_size

        # The region holds the plain layout and the manifest, written last.
        region = tmp_path / "region-local" / "run-a" / "step-000000000010"
        manifest = json.loads((region / "MANIFEST.json").read_text())
        assert manifest["run"] == "run-a" and manifest["step"] == 10
        assert {f["path"]: f["sha256"] for f in manifest["files"]} == {
            p: e["sha256"] for p, e in by_path.items()
        }
        for relative in by_path:
            assert sha256_of(region / "rank-00000" / relative) == by_path[relative]["sha256"]

        latest = (await agent.http.get("/v1/runs/run-a/latest")).json()
        assert latest["step"] == 10
        assert latest["locations"] == [{"region": "local", "uri": f"{region}/"}]

        # Restore through the real client over the app (POSIX objects are
        # streamed by the agent with Range support).
        async with AsyncCheckpointClient("http://agent", transport=agent.http._transport) as client:
            dest = await client.restore("run-a", tmp_path / "restored")
        for relative in by_path:
            assert sha256_of(dest / relative) == by_path[relative]["sha256"]


async def test_register_is_idempotent_and_conflicts_on_new_content(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        ckpt = write_checkpoint(agent.ssd / "r" / "s1", {"w.bin": 1000})
        first = await agent.register("r", 1, ckpt)
        again = await agent.register("r", 1, ckpt)
        assert (first.status_code, again.status_code) == (202, 200)
        await agent.wait_state("r", 1)

        (ckpt / "w.bin").write_bytes(os.urandom(2000))
        conflict = await agent.register("r", 1, ckpt)
        assert conflict.status_code == 409
        assert "different content" in conflict.json()["error"]["message"]
        detail = (await agent.http.get("/v1/runs/r/checkpoints/1")).json()
        assert detail["file_count"] == 1 and detail["state"] == "durable"


async def test_latest_is_highest_valid_step_and_skips_partial_and_failed(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        good = write_checkpoint(agent.ssd / "r" / "s5", {"w": 100})
        assert (await agent.register("r", 5, good)).status_code == 202
        await agent.wait_state("r", 5)

        # Step 7: rank 0 of 2 only. Uploaded, but never valid.
        half = write_checkpoint(agent.ssd / "r" / "s7-rank0", {"w": 100})
        assert (await agent.register("r", 7, half, rank=0, world_size=2)).status_code == 202

        for _ in range(400):
            shard7 = (await agent.http.get("/v1/runs/r/checkpoints/7")).json()
            if shard7["shards"][0]["state"] == "uploaded":
                break
            await asyncio.sleep(0.05)
        assert shard7["shards"][0]["state"] == "uploaded"
        assert shard7["state"] in ("registered", "uploading")

        latest = await agent.http.get("/v1/runs/r/latest")
        assert latest.status_code == 200 and latest.json()["step"] == 5

        # The second rank arrives: now step 7 is valid and the answer.
        other = write_checkpoint(agent.ssd / "r" / "s7-rank1", {"w": 50})
        assert (await agent.register("r", 7, other, rank=1, world_size=2)).status_code == 202
        done = await agent.wait_state("r", 7)
        assert sorted(s["rank"] for s in done["shards"]) == [0, 1]
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 7


async def test_file_changed_after_registration_fails_the_checkpoint(
    catalog_url: str, tmp_path: Path
) -> None:
    # Registered while no worker runs; the file changes before any upload.
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        good = write_checkpoint(agent.ssd / "r" / "s5", {"w": 100})
        doomed = write_checkpoint(agent.ssd / "r" / "s9", {"w": 100})
        assert (await agent.register("r", 5, good)).status_code == 202
        assert (await agent.register("r", 9, doomed)).status_code == 202
    (doomed / "w").write_bytes(os.urandom(100))
    os.utime(doomed / "w", ns=(7, 7))
    async with running_agent(catalog_url, tmp_path) as agent:
        await agent.wait_state("r", 5)
        failed = await agent.wait_state("r", 9, states=("failed",))
        assert "changed after registration" in failed["error"]
        assert failed["shards"][0]["state"] == "failed"
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 5


async def test_bad_input_is_a_clear_4xx_and_records_nothing(
    catalog_url: str, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    write_checkpoint(outside, {"secret": b"s"})
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        ok_dir = write_checkpoint(agent.ssd / "ok", {"w": b"1"})
        escape = write_checkpoint(agent.ssd / "esc", {"w": b"1"})
        (escape / "link").symlink_to(outside / "secret")
        fifo_dir = write_checkpoint(agent.ssd / "fifo", {"w": b"1"})
        os.mkfifo(fifo_dir / "pipe")
        cases = [
            ({"run": "r", "step": 1, "path": str(outside)}, 400, "path_outside_roots"),
            ({"run": "r", "step": 1, "path": f"{agent.ssd}/../outside"}, 400, "path_outside_roots"),
            ({"run": "r", "step": 1, "path": str(agent.ssd / "missing")}, 400, "path_not_found"),
            ({"run": "r", "step": 1, "path": "relative/dir"}, 400, "path_not_absolute"),
            ({"run": "bad run!", "step": 1, "path": str(ok_dir)}, 422, "invalid_request"),
            ({"run": "r", "step": -1, "path": str(ok_dir)}, 422, "invalid_request"),
            (
                {"run": "r", "step": 1, "path": str(ok_dir), "rank": 2, "world_size": 2},
                422,
                "invalid_request",
            ),
            ({"run": "r", "step": 1, "path": str(ok_dir), "colour": "red"}, 422, "invalid_request"),
            ({"run": "r", "step": 1, "path": str(escape)}, 400, "symlink_outside_roots"),
            ({"run": "r", "step": 1, "path": str(fifo_dir)}, 400, "special_file"),
            (
                {
                    "run": "r",
                    "step": 1,
                    "path": str(ok_dir),
                    "files": [{"path": "nope", "sha256": "0" * 64}],
                },
                400,
                "unknown_file",
            ),
        ]
        for body, status, code in cases:
            answer = await agent.http.post("/v1/checkpoints", json=body)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert error["code"] == code, (body, error)
            assert error["message"]
        malformed = await agent.http.post(
            "/v1/checkpoints", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 422 and "error" in malformed.json()
        assert "pipe" in (await agent.register("r", 1, fifo_dir)).json()["error"]["message"]
        assert (await agent.http.get("/v1/runs")).json() == {"runs": [], "total": 0}
        assert (await agent.http.get("/v1/runs/r/latest")).status_code == 404


async def test_client_hash_mismatch_fails_the_checkpoint(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        ckpt = write_checkpoint(agent.ssd / "r" / "s1", {"w": b"payload"})
        answer = await agent.register("r", 1, ckpt, files=[{"path": "w", "sha256": "a" * 64}])
        assert answer.status_code == 202
        failed = await agent.wait_state("r", 1, states=("failed",))
        assert "does not match" in failed["error"]
        assert (await agent.http.get("/v1/runs/r/latest")).status_code == 404


async def test_listing_and_health(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        for step in (1, 2, 3):
            ckpt = write_checkpoint(agent.ssd / "r" / f"s{step}", {"w": step * 10})
            assert (await agent.register("r", step, ckpt)).status_code == 202
        for step in (1, 2, 3):
            await agent.wait_state("r", step)
        page = (await agent.http.get("/v1/runs/r/checkpoints", params={"limit": 2})).json()
        assert page["total"] == 3 and [c["step"] for c in page["checkpoints"]] == [3, 2]
        ranged = (
            await agent.http.get("/v1/runs/r/checkpoints", params={"min_step": 2, "max_step": 2})
        ).json()
        assert [c["step"] for c in ranged["checkpoints"]] == [2]
        runs = (await agent.http.get("/v1/runs")).json()
        assert runs["runs"][0]["run"] == "r" and runs["runs"][0]["checkpoints"] == 3
        assert (await agent.http.get("/healthz")).json() == {"status": "ok"}
        assert (await agent.http.get("/readyz")).status_code == 200
        missing = await agent.http.get("/v1/runs/r/checkpoints/99")
        assert (
            missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
        )


async def test_urgent_reregistration_promotes_queued_work(catalog_url: str, tmp_path: Path) -> None:
    from sqlalchemy import select

    from tierckpt.service.db import transaction
    from tierckpt.service.models import Job

    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "r" / "s1", {"w": b"1"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        again = await agent.register("r", 1, ckpt, priority="urgent")
        assert again.status_code == 200 and again.json()["priority"] == "urgent"
        async with transaction(agent.resources.sessionmaker) as session:
            priorities = list(await session.scalars(select(Job.priority)))
        assert priorities == [100]
