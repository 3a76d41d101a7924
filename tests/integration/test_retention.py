"""Retention across tiers on a real SeaweedFS region: objects go, the latest
valid and pinned checkpoints stay; quarantine, explicit delete, T0 eviction
and the expiry of checkpoints whose ranks never all arrived."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update

from devsupport.agent import Agent, running_agent, s3_region, write_checkpoint
from devsupport.seaweed import SeaweedServer
from tierckpt.service.db import transaction
from tierckpt.service.models import Checkpoint, utcnow
from tierckpt.service.retention.service import apply_all, evict_local_copies


def keys_of_step(s3_client: Any, bucket: str, step: int) -> set[str]:
    prefix = f"prod/r/step-{step:012d}/"
    answer = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for o in answer.get("Contents", [])}


async def wait_deleted(agent: Agent, step: int) -> dict[str, Any]:
    for _ in range(600):
        detail = (await agent.http.get(f"/v1/runs/r/checkpoints/{step}")).json()
        if detail["state"] == "deleted" and detail["deleted_at"]:
            return detail
        await asyncio.sleep(0.05)
    raise AssertionError(f"step {step} not deleted: {detail}")


async def test_retention_deletes_objects_but_keeps_latest_and_pinned(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", seaweed.endpoint_url, s3_bucket)]
    async with running_agent(catalog_url, tmp_path, regions, local={"keep_last": 1}) as agent:
        for step in range(1, 7):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": 1000 + step, "m/x": b"x"})
            answer = await agent.register(
                "r", step, ckpt, metrics={"loss": 10 - step if step != 2 else 0.1}
            )
            assert answer.status_code == 202
            await agent.wait_state("r", step)
        assert all(keys_of_step(s3_client, s3_bucket, s) for s in range(1, 7))

        # Step 4 pinned; step 6 quarantined, so the latest valid is 5.
        assert (await agent.http.post("/v1/runs/r/checkpoints/4/pin")).json()["pinned"] is True
        quarantined = await agent.http.post(
            "/v1/runs/r/checkpoints/6/quarantine", json={"reason": "loss diverged after it"}
        )
        assert quarantined.json()["quarantine_reason"] == "loss diverged after it"
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 5

        policy = {"keep_last": 1, "keep_best": {"metric": "loss", "mode": "min", "n": 1}}
        put = await agent.http.put("/v1/runs/r/retention", json=policy)
        assert put.status_code == 200 and put.json()["overridden"] is True
        # keep_last=1 keeps 6 (quarantined, still the newest); keep_best keeps
        # 2; 5 is the latest valid; 4 is pinned: 1 and 3 go.
        assert put.json()["would_delete"] == [1, 3]
        applied = (await agent.http.post("/v1/runs/r/retention/apply")).json()
        assert applied["delete_queued"] == [1, 3]
        for step in (1, 3):
            detail = await wait_deleted(agent, step)
            assert detail["deleted_reason"].startswith("retention (keep_last=1")
            assert [r["state"] for r in detail["replicas"]] == ["deleted"]
            assert keys_of_step(s3_client, s3_bucket, step) == set()
        for step in (2, 4, 5, 6):
            assert len(keys_of_step(s3_client, s3_bucket, step)) == 3  # 2 files + manifest

        # Explicit delete: pinned refused, latest refused without force.
        assert (await agent.http.delete("/v1/runs/r/checkpoints/4")).status_code == 409
        latest_delete = await agent.http.delete("/v1/runs/r/checkpoints/5")
        assert (
            latest_delete.status_code == 409
            and latest_delete.json()["error"]["code"] == "latest_valid"
        )
        assert (await agent.http.delete("/v1/runs/r/checkpoints/2")).status_code == 202
        await wait_deleted(agent, 2)
        assert keys_of_step(s3_client, s3_bucket, 2) == set()

        # Lifting the quarantine makes 6 the answer again.
        await agent.http.delete("/v1/runs/r/checkpoints/6/quarantine")
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 6

        pinned = (await agent.http.get("/v1/runs/r/checkpoints", params={"pinned": "true"})).json()
        assert [c["step"] for c in pinned["checkpoints"]] == [4]
        deleted = (
            await agent.http.get("/v1/runs/r/checkpoints", params={"state": "deleted"})
        ).json()
        assert sorted(c["step"] for c in deleted["checkpoints"]) == [1, 2, 3]


async def test_t0_copies_are_evicted_only_when_durable_and_beyond_keep_last(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(
        catalog_url, tmp_path, local={"keep_last": 2}, start_worker=False
    ) as agent:
        dirs = {}
        for step in range(1, 5):
            dirs[step] = write_checkpoint(
                agent.ssd / "run" / f"s{step}", {"a/w.bin": 10, "b": b"1"}
            )
            assert (await agent.register("r", step, dirs[step])).status_code == 202
        # Nothing is durable yet: nothing may be evicted.
        assert await evict_local_copies(agent.resources) == 0
    async with running_agent(catalog_url, tmp_path, local={"keep_last": 2}) as agent:
        for step in range(1, 5):
            await agent.wait_state("r", step)
        assert await evict_local_copies(agent.resources) == 2
        assert not dirs[1].exists() and not dirs[2].exists()
        assert (dirs[3] / "a" / "w.bin").exists() and (dirs[4] / "b").exists()
        assert (agent.ssd / "run").is_dir()  # never above the shard's own directory
        detail = (await agent.http.get("/v1/runs/r/latest", params={"node": "node-test"})).json()
        assert detail["step"] == 4 and detail["local"]["path"] == str(dirs[4].resolve())


async def test_missing_ranks_expire_and_never_shadow_an_older_checkpoint(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        whole = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        assert (await agent.register("r", 1, whole)).status_code == 202
        await agent.wait_state("r", 1)
        half = write_checkpoint(agent.ssd / "s2", {"w": b"2"})
        assert (await agent.register("r", 2, half, rank=0, world_size=4)).status_code == 202
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 1

        async with transaction(agent.resources.sessionmaker) as session:
            await session.execute(
                update(Checkpoint)
                .where(Checkpoint.step == 2)
                .values(created_at=utcnow() - timedelta(days=2))
            )
        outcome = await apply_all(agent.resources)
        assert outcome["expired"] == 1
        detail = (await agent.http.get("/v1/runs/r/checkpoints/2")).json()
        assert detail["state"] == "failed" and "only 1 of 4 ranks" in detail["error"]
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 1


async def test_eviction_of_a_single_file_checkpoint_keeps_the_trainers_directory(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, local={"keep_last": 0}) as agent:
        out = agent.ssd / "trainer-out"
        (out / "logs").mkdir(parents=True)
        model = write_checkpoint(out, {"model-1.pt": b"w"}) / "model-1.pt"
        assert (await agent.register("r", 1, model)).status_code == 202
        await agent.wait_state("r", 1)
        assert await evict_local_copies(agent.resources) == 1
        assert not model.exists()
        assert out.is_dir() and (out / "logs").is_dir()  # not the checkpoint's to remove
