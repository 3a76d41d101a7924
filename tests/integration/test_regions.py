"""Two real SeaweedFS regions: replication, outage, corruption, repair, fallback."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import Agent, AgentOrNetwork, running_agent, s3_region, write_checkpoint
from devsupport.seaweed import SeaweedServer, boto3_client, overwrite_object
from tests.integration.test_metrics import scrape, value
from tierckpt.client import AsyncCheckpointClient

PREFIX = "prod"


def key(run: str, step: int, path: str) -> str:
    return f"{PREFIX}/{run}/step-{step:012d}/rank-00000/{path}"


def remote_sha256(client: Any, bucket: str, object_key: str) -> str:
    return hashlib.sha256(
        client.get_object(Bucket=bucket, Key=object_key)["Body"].read()
    ).hexdigest()


@pytest.fixture
def west_bucket(seaweed_west: SeaweedServer) -> str:
    import uuid

    return seaweed_west.create_bucket(f"west-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def west_client(seaweed_west: SeaweedServer) -> Any:
    return boto3_client(seaweed_west.endpoint_url)


def two_regions(
    seaweed: SeaweedServer,
    east: str,
    seaweed_west: SeaweedServer,
    west: str,
    *,
    west_fails_fast: bool = False,
) -> list[dict[str, Any]]:
    """``west_fails_fast``: for a test that stops west; each job attempt then
    fails at its first refused request and the worker's backoff retries it."""
    west_region = s3_region("west", seaweed_west.endpoint_url, west)
    if west_fails_fast:
        west_region["request_attempts"] = 1
    return [s3_region("east", seaweed.endpoint_url, east), west_region]


async def replica(agent: Agent, run: str, step: int, region: str) -> dict[str, Any]:
    detail = (await agent.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
    return next(r for r in detail["replicas"] if r["region"] == region)


async def wait_replica(
    agent: Agent, run: str, step: int, region: str, state: str, timeout: float = 60
) -> dict[str, Any]:
    for _ in range(int(timeout / 0.05)):
        found = await replica(agent, run, step, region)
        if found["state"] == state:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{region} replica of {run}/{step} never became {state}: {found}")


async def verify_and_wait(agent: Agent, run: str, step: int) -> dict[str, Any]:
    answer = await agent.http.post(f"/v1/runs/{run}/checkpoints/{step}/verify")
    assert answer.status_code == 202, answer.text
    for _ in range(1200):
        detail = (await agent.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
        if not any(
            j["kind"] == "verify" and j["state"] in ("queued", "running") for j in detail["jobs"]
        ):
            return detail
        await asyncio.sleep(0.05)
    raise AssertionError("verification did not finish")


@pytest.mark.parametrize("fan_out", [True, False], ids=["fan-out", "replicate"])
async def test_replicates_to_a_second_region_with_manifest_last(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
    seaweed_west: SeaweedServer,
    west_bucket: str,
    west_client: Any,
    fan_out: bool,
) -> None:
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket)
    upload = {"fan_out": fan_out}
    async with running_agent(catalog_url, tmp_path, regions, upload=upload) as agent:
        ckpt = write_checkpoint(
            agent.ssd / "s1", {"big.bin": 12 << 20, "a/small": b"s", "empty": b""}
        )
        assert (await agent.register("llm", 1, ckpt)).status_code == 202
        done = await agent.wait_state("llm", 1, states=("replicated",))
        assert [(r["region"], r["state"]) for r in done["replicas"]] == [
            ("east", "committed"),
            ("west", "committed"),
        ]
        west_jobs = {(j["kind"], j["state"]) for j in done["jobs"] if j["region"] == "west"}
        if fan_out:
            # Uploaded from the T0 copy alongside east, hashed on the way out
            # like the primary. The first region's commit queued a replicate
            # job into the other (a safety net, 30 s away); the other's commit
            # marked it done: it never ran.
            assert ("upload", "succeeded") in west_jobs and ("commit", "succeeded") in west_jobs
            safety_net = [j for j in done["jobs"] if j["kind"] == "replicate"]
            assert [(j["state"], j["attempts"]) for j in safety_net] == [("succeeded", 0)]
        else:
            # Streamed between two servers: every byte was hashed on the way.
            assert done["replicas"][1]["verified_at"] is not None
            assert ("replicate", "succeeded") in west_jobs
        for entry in done["files"]:
            assert (
                remote_sha256(s3_client, s3_bucket, key("llm", 1, entry["path"])) == entry["sha256"]
            )
            assert (
                remote_sha256(west_client, west_bucket, key("llm", 1, entry["path"]))
                == entry["sha256"]
            )
        west_manifest = west_client.get_object(
            Bucket=west_bucket, Key=f"{PREFIX}/llm/step-000000000001/MANIFEST.json"
        )
        east_manifest = s3_client.get_object(
            Bucket=s3_bucket, Key=f"{PREFIX}/llm/step-000000000001/MANIFEST.json"
        )
        assert west_manifest["Body"].read() == east_manifest["Body"].read()
        latest_west = (
            await agent.http.get("/v1/runs/llm/latest", params={"region": "west"})
        ).json()
        assert latest_west["step"] == 1


async def test_fan_out_reads_and_hashes_each_file_once_for_both_regions(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
    seaweed_west: SeaweedServer,
    west_bucket: str,
    west_client: Any,
) -> None:
    """The primary's upload sends each part it reads to the fan-out region
    too: T0 is read (and hashed) once, not once per region."""
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket)
    # Parts of 5 MiB: the 12 MiB file goes as a multipart upload to both.
    upload = {"fan_out": True, "dedup": False, "part_size_mb": 5}
    async with running_agent(catalog_url, tmp_path, regions, upload=upload) as agent:
        files = {"big.bin": 12 << 20, "small.json": b"{}"}
        total = (12 << 20) + 2
        ckpt = write_checkpoint(agent.ssd / "s1", files)
        _, before = await scrape(agent)
        assert (await agent.register("once", 1, ckpt)).status_code == 202
        done = await agent.wait_state("once", 1, states=("replicated",))
        _, after = await scrape(agent)

        def delta(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("tierckpt_upload_read_bytes_total") == total
        assert delta("tierckpt_uploaded_bytes_total", region="east") == total
        assert delta("tierckpt_uploaded_bytes_total", region="west") == total
        west_upload = next(
            j for j in done["jobs"] if j["region"] == "west" and j["kind"] == "upload"
        )
        assert (west_upload["state"], west_upload["attempts"]) == ("succeeded", 1)
        for entry in done["files"]:
            object_key = key("once", 1, entry["path"])
            assert remote_sha256(s3_client, s3_bucket, object_key) == entry["sha256"]
            assert remote_sha256(west_client, west_bucket, object_key) == entry["sha256"]


async def test_same_endpoint_regions_copy_server_side(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    other = seaweed.create_bucket(f"copy-{os.urandom(6).hex()}")
    regions = [
        s3_region("east", seaweed.endpoint_url, s3_bucket),
        s3_region("east-b", seaweed.endpoint_url, other),
    ]
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 7 << 20})
        assert (await agent.register("cp", 1, ckpt)).status_code == 202
        done = await agent.wait_state("cp", 1, states=("replicated",))
        copied = done["replicas"][1]
        assert (
            copied["state"] == "committed" and copied["verified_at"] is None
        )  # not re-read: server-side
        assert remote_sha256(s3_client, other, key("cp", 1, "w.bin")) == done["files"][0]["sha256"]


async def test_region_outage_delays_replication_and_loses_nothing(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    seaweed_west: SeaweedServer,
    west_bucket: str,
    west_client: Any,
) -> None:
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket, west_fails_fast=True)
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        seaweed_west.stop()
        try:
            ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 6 << 20})
            assert (await agent.register("o", 1, ckpt)).status_code == 202
            durable = await agent.wait_state("o", 1, states=("durable",))
            assert durable["state"] == "durable"
            await asyncio.sleep(1.5)  # a few failed attempts against the dead region
            detail = (await agent.http.get("/v1/runs/o/checkpoints/1")).json()
            # West is filled by the upload from T0 (fan-out) or by replication;
            # either way the job retries against the dead region.
            job = next(j for j in detail["jobs"] if j["region"] == "west" and j["attempts"])
            assert job["state"] in ("queued", "running") and job["attempts"] >= 1
            west = next(r for r in detail["replicas"] if r["region"] == "west")
            assert west["state"] == "pending" and west["lag_seconds"] >= 1.0  # lag shown
            assert (await agent.http.get("/v1/runs/o/latest")).json()["step"] == 1
            assert (
                await agent.http.get("/v1/runs/o/latest", params={"region": "west"})
            ).status_code == 404
        finally:
            seaweed_west.start()
        done = await agent.wait_state("o", 1, states=("replicated",), timeout=120)
        assert (
            remote_sha256(west_client, west_bucket, key("o", 1, "w.bin"))
            == done["files"][0]["sha256"]
        )


async def test_garbage_is_restored_around_detected_and_repaired(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
    seaweed_west: SeaweedServer,
    west_bucket: str,
) -> None:
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket)
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 9 << 20, "meta.json": b"{}"})
        assert (await agent.register("g", 1, ckpt)).status_code == 202
        done = await agent.wait_state("g", 1, states=("replicated",))
        good = done["files"]
        # Garbage of the same size, written behind tierckpt's back.
        overwrite_object(s3_client, s3_bucket, key("g", 1, "w.bin"), os.urandom(9 << 20))

        # Restore prefers east, sees the hash mismatch, falls back to west.
        async with AsyncCheckpointClient(
            "http://agent", transport=AgentOrNetwork(agent.http._transport)
        ) as c:
            dest = await c.restore("g", tmp_path / "restored", region="east")
        assert hashlib.sha256((dest / "w.bin").read_bytes()).hexdigest() == next(
            f["sha256"] for f in good if f["path"] == "w.bin"
        )

        detail = await verify_and_wait(agent, "g", 1)
        east = next(r for r in detail["replicas"] if r["region"] == "east")
        assert east["state"] in ("corrupt", "committed")  # repaired may already be done
        repaired = await wait_replica(agent, "g", 1, "east", "committed")
        assert repaired["error"] is None
        assert remote_sha256(s3_client, s3_bucket, key("g", 1, "w.bin")) == next(
            f["sha256"] for f in good if f["path"] == "w.bin"
        )
        assert (await agent.wait_state("g", 1, states=("replicated",)))["state"] == "replicated"


async def test_every_copy_corrupt_falls_back_then_repairs_from_local_copy(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", seaweed.endpoint_url, s3_bucket)]
    async with running_agent(catalog_url, tmp_path, regions) as agent:
        older = write_checkpoint(agent.ssd / "s1", {"w.bin": 1 << 20})
        newer = write_checkpoint(agent.ssd / "s2", {"w.bin": 1 << 20})
        lost = write_checkpoint(agent.ssd / "s3", {"w.bin": 1 << 20})
        for step, path in ((1, older), (2, newer), (3, lost)):
            assert (await agent.register("c", step, path)).status_code == 202
            await agent.wait_state("c", step)

        # Step 3: the only region copy is garbage and the T0 copy was
        # overwritten by the trainer: nothing intact is left.
        overwrite_object(s3_client, s3_bucket, key("c", 3, "w.bin"), b"garbage")
        (lost / "w.bin").write_bytes(os.urandom(1 << 20))
        detail = await verify_and_wait(agent, "c", 3)
        assert detail["state"] == "corrupt"
        assert "size" in detail["replicas"][0]["error"]
        await asyncio.sleep(0.5)  # the T0 repair runs and fails
        assert (await agent.http.get("/v1/runs/c/latest")).json()["step"] == 2

        # Step 2: garbage in the region, but the T0 copy is intact: repaired.
        overwrite_object(s3_client, s3_bucket, key("c", 2, "w.bin"), os.urandom(1 << 20))
        detail = await verify_and_wait(agent, "c", 2)
        latest = (await agent.http.get("/v1/runs/c/latest")).json()
        assert latest["step"] in (1, 2)  # 1 while the repair runs, 2 once done
        await agent.wait_state("c", 2)
        assert (await agent.http.get("/v1/runs/c/latest")).json()["step"] == 2
        assert (
            remote_sha256(s3_client, s3_bucket, key("c", 2, "w.bin"))
            == hashlib.sha256((newer / "w.bin").read_bytes()).hexdigest()
        )
        assert (await agent.http.get("/v1/runs/c/checkpoints/3")).json()["state"] == "corrupt"


async def test_fan_out_that_gives_up_falls_back_to_replication(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    seaweed_west: SeaweedServer,
    west_bucket: str,
    west_client: Any,
) -> None:
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket, west_fails_fast=True)
    worker = {"max_attempts": 2, "backoff_base": 0.1, "backoff_max": 0.5, "poll_interval": 0.05}
    async with running_agent(catalog_url, tmp_path, regions, worker=worker) as agent:
        seaweed_west.stop()
        try:
            ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 6 << 20, "m.json": b"{}"})
            assert (await agent.register("fb", 1, ckpt)).status_code == 202
            await agent.wait_state("fb", 1, states=("durable",))
            # Each west attempt pays botocore's retries against a dead
            # endpoint, and the second one first tries to clear open uploads:
            # on a loaded machine that took over 20 s.
            for _ in range(1800):
                detail = (await agent.http.get("/v1/runs/fb/checkpoints/1")).json()
                west_jobs = [j for j in detail["jobs"] if j["region"] == "west"]
                if any(j["kind"] == "upload" and j["state"] == "failed" for j in west_jobs) and any(
                    j["kind"] == "replicate" and j["attempts"] for j in west_jobs
                ):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"no fallback to replication: {west_jobs}")
            west = next(r for r in detail["replicas"] if r["region"] == "west")
            assert west["state"] == "pending" and "upload from T0 failed" in west["error"]
            assert detail["state"] == "durable"  # the east copy is unaffected
        finally:
            seaweed_west.start()
        done = await agent.wait_state("fb", 1, states=("replicated",), timeout=120)
        for entry in done["files"]:
            assert (
                remote_sha256(west_client, west_bucket, key("fb", 1, entry["path"]))
                == (entry["sha256"])
            )


async def test_replication_supersedes_a_fan_out_upload_that_never_started(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    seaweed_west: SeaweedServer,
    west_bucket: str,
    west_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node holding T0 is gone before its upload into west started: the
    replicate job (any agent) copies west from east instead of waiting forever."""
    from sqlalchemy import select

    from tierckpt.service.db import transaction
    from tierckpt.service.jobs import kinds, queue
    from tierckpt.service.models import Shard

    monkeypatch.setattr(kinds, "FAN_OUT_GRACE_SECONDS", 0.2)
    regions = two_regions(seaweed, s3_bucket, seaweed_west, west_bucket)
    async with running_agent(catalog_url, tmp_path, regions, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 3 << 20})
        assert (await agent.register("gone", 1, ckpt)).status_code == 202
        # The west upload as the fan-out queues it (its stored payload, as
        # every agent version writes it), but bound to a node whose agent
        # never comes back (the primary's own fan-out then dedupes on it).
        async with transaction(agent.resources.sessionmaker) as session:
            shard = (await session.scalars(select(Shard))).one()
            assert await queue.enqueue(
                session,
                "upload",
                shard.checkpoint_id,
                shard_id=shard.id,
                region="west",
                node="node-that-is-gone",
                payload={"fan_out": True},
            )
    worker = {"poll_interval": 0.05}
    async with running_agent(
        catalog_url, tmp_path, regions, ssd=tmp_path / "ssd", worker=worker
    ) as agent:
        done = await agent.wait_state("gone", 1, states=("replicated",), timeout=60)
        west_jobs = {(j["kind"], j["state"]) for j in done["jobs"] if j["region"] == "west"}
        assert ("replicate", "succeeded") in west_jobs
        assert (
            remote_sha256(west_client, west_bucket, key("gone", 1, "w.bin"))
            == (done["files"][0]["sha256"])
        )
