"""The object store slow or failing (503 SlowDown, 500), through a real
fault-injecting proxy in front of real SeaweedFS.

Uploads complete once the store recovers, with retries spaced by backoff
and jitter (botocore's own, then the worker's): the proxy counts every
attempt, so a busy loop would show.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import running_agent, s3_region, write_checkpoint
from devsupport.s3proxy import S3FaultProxy
from devsupport.seaweed import SeaweedServer

PREFIX = "prod"


@pytest.fixture
def proxy(seaweed: SeaweedServer) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(seaweed.endpoint_url) as running:
        yield running


def catalog(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"


def remote_sha256(client: Any, bucket: str, key: str) -> str:
    return hashlib.sha256(client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()


def check_bytes(client: Any, bucket: str, run: str, step: int, ckpt: Path) -> None:
    for path in ckpt.rglob("*"):
        if path.is_file():
            relative = path.relative_to(ckpt).as_posix()
            key = f"{PREFIX}/{run}/step-{step:012d}/rank-00000/{relative}"
            assert (
                remote_sha256(client, bucket, key) == hashlib.sha256(path.read_bytes()).hexdigest()
            )
    client.head_object(Bucket=bucket, Key=f"{PREFIX}/{run}/step-{step:012d}/MANIFEST.json")


async def test_slowdown_then_recovery_uploads_with_backoff(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        big = write_checkpoint(agent.ssd / "s1", {"w.bin": 12 << 20, "small": b"s"})
        small = write_checkpoint(agent.ssd / "s2", {"w.bin": 4096})
        window = 5.0
        proxy.fail(503, "SlowDown", seconds=window)
        started = time.monotonic()
        assert (await agent.register("r", 1, big)).status_code == 202
        assert (await agent.register("r", 2, small)).status_code == 202

        for step in (1, 2):
            done = await agent.wait_state("r", step, timeout=120)
            assert done["state"] == "durable"
        elapsed = time.monotonic() - started
        assert elapsed >= window * 0.9, "nothing can be durable while the store throttles"

        faults = proxy.faults()
        # Every request in the window was throttled, and there were few:
        # a busy loop over two checkpoints would send thousands in 5 s.
        assert faults, "the proxy saw no request during the SlowDown window"
        assert len(faults) <= 80, f"{len(faults)} attempts in {window:.0f} s: not backing off"
        gaps = [b.at - a.at for a, b in itertools.pairwise(faults)]
        if len(gaps) >= 4:
            assert statistics.median(gaps) >= 0.02, gaps
        # Retried until accepted: the same kind of request succeeded afterwards.
        passed_after = [s for s in proxy.log if not s.fault and s.at >= faults[-1].at]
        assert any(s.method in ("PUT", "POST") and s.status == 200 for s in passed_after)

        check_bytes(s3_client, s3_bucket, "r", 1, big)
        check_bytes(s3_client, s3_bucket, "r", 2, small)
        detail = (await agent.http.get("/v1/runs/r/checkpoints/1")).json()
        upload = next(j for j in detail["jobs"] if j["kind"] == "upload")
        assert upload["state"] == "succeeded"


async def test_internal_errors_for_a_number_of_requests(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 11 << 20, "b": b"b"})
        proxy.fail(500, "InternalError", count=12)
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        done = await agent.wait_state("r", 1, timeout=120)
        assert done["state"] == "durable"
        assert len(proxy.faults()) == 12
        check_bytes(s3_client, s3_bucket, "r", 1, ckpt)


async def test_slow_store_still_completes(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 11 << 20, "b": b"b"})
        proxy.delay(0.4)
        started = time.monotonic()
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        done = await agent.wait_state("r", 1, timeout=120)
        assert done["state"] == "durable"
        # create, 3 parts (two in parallel), complete, manifest: >= 4 round trips.
        assert time.monotonic() - started >= 4 * 0.4
        proxy.clear()
        latest = (await agent.http.get("/v1/runs/r/latest")).json()
        assert latest["step"] == 1
        check_bytes(s3_client, s3_bucket, "r", 1, ckpt)


async def test_a_store_refusing_to_list_uploads_does_not_block_deletion(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """A bucket policy without s3:ListBucketMultipartUploads: the deletion's
    clean-up of open uploads is refused (403), and the deletion still
    completes instead of retrying for ever (storage/leftovers.py)."""
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 4096})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        assert (await agent.wait_state("r", 1))["state"] == "durable"

        def lists_uploads(request: Any) -> bool:
            return request.method == "GET" and "uploads" in request.query

        proxy.fail(403, "AccessDenied", only=lists_uploads)
        deleted = await agent.http.delete("/v1/runs/r/checkpoints/1", params={"force": "true"})
        assert deleted.status_code == 202, deleted.text
        deadline = time.monotonic() + 60
        while True:
            detail = (await agent.http.get("/v1/runs/r/checkpoints/1")).json()
            job = next(j for j in detail["jobs"] if j["kind"] == "delete")
            if job["state"] in ("succeeded", "failed") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert job["state"] == "succeeded", job
        assert detail["state"] == "deleted"
        refused = proxy.faults()
        assert refused and all(s.method == "GET" and s.status == 403 for s in refused), refused
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/r/")
        assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
