"""Dedup on real SeaweedFS (and a POSIX region): unchanged files of a new
checkpoint are copied server-side into its own keys instead of being sent."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import (
    Agent,
    AgentOrNetwork,
    posix_region,
    running_agent,
    s3_region,
    write_checkpoint,
)
from devsupport.seaweed import SeaweedServer
from tierckpt.client import AsyncCheckpointClient
from tierckpt.service.observability import metrics
from tierckpt.service.storage import s3 as s3_module

MiB = 1024 * 1024
PREFIX = "prod"
# Step 2 keeps these byte for byte (90 % of its bytes) ...
UNCHANGED = {"model/w-1.bin": 8 * MiB, "model/w-2.bin": 6 * MiB, "optim/o.bin": 4 * MiB}
# ... and rewrites these: same names, same sizes, new bytes.
CHANGED = {"head.bin": 2 * MiB - 64 * 1024, "config.json": 64 * 1024}


def counters(region: str) -> tuple[float, float]:
    """(uploaded, deduplicated) bytes this process has counted for ``region``."""

    def get(name: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, {"region": region}) or 0.0

    return get("tierckpt_uploaded_bytes_total"), get("tierckpt_dedup_bytes_total")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def object_sha256(client: Any, bucket: str, key: str) -> tuple[int, str]:
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    digest, size = hashlib.sha256(), 0
    for chunk in iter(lambda: body.read(1 << 20), b""):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def two_steps(ssd: Path) -> tuple[Path, Path]:
    """Step 1: every file random. Step 2: UNCHANGED copied (new inodes, new
    mtimes: nothing but the bytes says they are the same), CHANGED rewritten."""
    first = write_checkpoint(ssd / "step-1", {**UNCHANGED, **CHANGED})
    second = write_checkpoint(ssd / "step-2", dict(CHANGED))
    for relative in UNCHANGED:
        (second / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first / relative, second / relative)
    return first, second


async def durable(agent: Agent, run: str, step: int, path: Path, **extra: Any) -> dict[str, Any]:
    answer = await agent.register(run, step, path, **extra)
    assert answer.status_code == 202, answer.text
    done = await agent.wait_state(run, step)
    assert done["state"] == "durable", done
    return done


async def delete_and_wait(agent: Agent, run: str, step: int) -> None:
    answer = await agent.http.delete(f"/v1/runs/{run}/checkpoints/{step}")
    assert answer.status_code == 202, answer.text
    for _ in range(1200):
        detail = (await agent.http.get(f"/v1/runs/{run}/checkpoints/{step}")).json()
        if detail["state"] == "deleted" and detail["deleted_at"]:
            assert [r["state"] for r in detail["replicas"]] == ["deleted"]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run}/{step} was not deleted: {detail}")


async def test_unchanged_files_are_copied_server_side_not_sent(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    region = s3_region("east", seaweed.endpoint_url, s3_bucket, prefix=PREFIX)
    async with running_agent(catalog_url, tmp_path, [region]) as agent:
        first, second = two_steps(agent.ssd)
        sent0, copied0 = counters("east")
        await durable(agent, "llm", 1, first)
        sent1, copied1 = counters("east")
        total = sum(UNCHANGED.values()) + sum(CHANGED.values())
        assert (sent1 - sent0, copied1 - copied0) == (total, 0)  # nothing to dedup from yet

        # One unchanged file comes with the client's own hash (looked up
        # directly), the others are found by path and size + probes + hash.
        given = "model/w-2.bin"
        done = await durable(
            agent,
            "llm",
            2,
            second,
            files=[{"path": given, "sha256": sha256_file(second / given)}],
        )
        sent2, copied2 = counters("east")
        assert copied2 - copied1 == sum(UNCHANGED.values())
        assert sent2 - sent1 == sum(CHANGED.values())
        assert (sent2 - sent1) / total <= 0.15

        # Plain full objects under step 2's own keys, byte-identical to the
        # local files, read with an independent client.
        prefix = f"{PREFIX}/llm/step-000000000002/"
        listed = {
            o["Key"]: o["Size"]
            for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)["Contents"]
        }
        expected = {f"{prefix}rank-00000/{p}": s for p, s in {**UNCHANGED, **CHANGED}.items()}
        assert {k: v for k, v in listed.items() if not k.endswith("MANIFEST.json")} == expected
        local = {p: sha256_file(second / p) for p in {**UNCHANGED, **CHANGED}}
        for relative, digest in local.items():
            key = f"{prefix}rank-00000/{relative}"
            assert object_sha256(s3_client, s3_bucket, key) == (listed[key], digest)
        manifest = json.loads(
            s3_client.get_object(Bucket=s3_bucket, Key=prefix + "MANIFEST.json")["Body"].read()
        )
        assert {f["path"]: f["sha256"] for f in manifest["files"]} == local
        assert {f["path"]: f["sha256"] for f in done["files"]} == local

        # Step 1 goes (retention / admin delete): step 2 does not depend on it.
        await delete_and_wait(agent, "llm", 1)
        gone = s3_client.list_objects_v2(
            Bucket=s3_bucket, Prefix=f"{PREFIX}/llm/step-000000000001/"
        )
        assert gone.get("KeyCount", 0) == 0
        for relative, digest in local.items():
            key = f"{prefix}rank-00000/{relative}"
            assert object_sha256(s3_client, s3_bucket, key)[1] == digest
        async with AsyncCheckpointClient(
            "http://agent", transport=AgentOrNetwork(agent.http._transport)
        ) as client:
            dest = await client.restore("llm", tmp_path / "restored", step=2)
        assert {p: sha256_file(dest / p) for p in local} == local


async def test_source_removed_before_the_copy_falls_back_to_upload(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    region = s3_region("east", seaweed.endpoint_url, s3_bucket, prefix=PREFIX)
    async with running_agent(catalog_url, tmp_path, [region]) as agent:
        first, second = two_steps(agent.ssd)
        await durable(agent, "gone", 1, first)
        # Removed behind the catalog's back (as if retention raced the
        # upload): the catalog still says step 1 is committed.
        for relative in UNCHANGED:
            s3_client.delete_object(
                Bucket=s3_bucket, Key=f"{PREFIX}/gone/step-000000000001/rank-00000/{relative}"
            )
        sent0, copied0 = counters("east")
        # w-2 with the client's hash: lookup hit, copy fails (NoSuchKey);
        # the others: the probe of the vanished object fails. All are sent.
        given = "model/w-2.bin"
        done = await durable(
            agent,
            "gone",
            2,
            second,
            files=[{"path": given, "sha256": sha256_file(second / given)}],
        )
        sent1, copied1 = counters("east")
        total = sum(UNCHANGED.values()) + sum(CHANGED.values())
        assert (sent1 - sent0, copied1 - copied0) == (total, 0)
        prefix = f"{PREFIX}/gone/step-000000000002/rank-00000/"
        for entry in done["files"]:
            assert entry["sha256"] == sha256_file(second / entry["path"])
            assert object_sha256(s3_client, s3_bucket, prefix + entry["path"]) == (
                entry["size"],
                entry["sha256"],
            )


async def test_large_objects_are_copied_part_by_part(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above CopyObject's 5 GiB limit the copy is UploadPartCopy; the limit
    is lowered here so a 12 MiB file takes that path on the real server."""
    monkeypatch.setattr(s3_module, "COPY_OBJECT_LIMIT", 5 * MiB)
    monkeypatch.setattr(s3_module, "COPY_PART_SIZE", 5 * MiB)
    region = s3_region("east", seaweed.endpoint_url, s3_bucket, prefix=PREFIX)
    async with running_agent(catalog_url, tmp_path, [region]) as agent:
        first = write_checkpoint(agent.ssd / "s1", {"big.bin": 12 * MiB + 3})
        second = agent.ssd / "s2"
        second.mkdir()
        shutil.copyfile(first / "big.bin", second / "big.bin")
        await durable(agent, "parts", 1, first)
        _, copied0 = counters("east")
        done = await durable(agent, "parts", 2, second)
        assert counters("east")[1] - copied0 == 12 * MiB + 3
        digest = sha256_file(second / "big.bin")
        assert done["files"][0]["sha256"] == digest
        key = f"{PREFIX}/parts/step-000000000002/rank-00000/big.bin"
        assert object_sha256(s3_client, s3_bucket, key) == (12 * MiB + 3, digest)


async def test_posix_region_copies_into_independent_files(catalog_url: str, tmp_path: Path) -> None:
    root = tmp_path / "region"
    async with running_agent(catalog_url, tmp_path, [posix_region("nfs", root)]) as agent:
        first, second = two_steps(agent.ssd)
        await durable(agent, "px", 1, first)
        sent0, copied0 = counters("nfs")
        await durable(agent, "px", 2, second)
        sent1, copied1 = counters("nfs")
        assert copied1 - copied0 == sum(UNCHANGED.values())
        assert sent1 - sent0 == sum(CHANGED.values())
        step1, step2 = root / "px" / "step-000000000001", root / "px" / "step-000000000002"
        for relative in UNCHANGED:
            old, new = step1 / "rank-00000" / relative, step2 / "rank-00000" / relative
            assert os.stat(old).st_ino != os.stat(new).st_ino  # a copy, not a link
        await delete_and_wait(agent, "px", 1)
        assert not any(p.is_file() for p in step1.rglob("*"))
        for relative in {**UNCHANGED, **CHANGED}:
            assert sha256_file(step2 / "rank-00000" / relative) == sha256_file(second / relative)
