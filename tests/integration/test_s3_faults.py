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
from devsupport.s3proxy import S3FaultProxy, Seen
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


def lists_uploads(request: Any) -> bool:
    """ListMultipartUploads (GET on the bucket with ?uploads), for a fault."""
    return request.method == "GET" and "uploads" in request.query


def is_upload_listing(seen: Seen) -> bool:
    """The same request in the proxy's log."""
    return seen.method == "GET" and "uploads" in seen.query.split("&")


async def delete_and_wait(agent: Any, run: str, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Delete (forced) and wait for the delete job to end: (detail, job)."""
    path = f"/v1/runs/{run}/checkpoints/{step}"
    deleted = await agent.http.delete(path, params={"force": "true"})
    assert deleted.status_code == 202, deleted.text
    deadline = time.monotonic() + 60
    while True:
        detail = (await agent.http.get(path)).json()
        job = next(j for j in detail["jobs"] if j["kind"] == "delete")
        if job["state"] in ("succeeded", "failed") or time.monotonic() > deadline:
            return detail, job
        await asyncio.sleep(0.1)


async def test_deleting_small_files_lists_no_open_uploads(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """Files no larger than the smallest part each went up in one PUT, which
    leaves nothing open in S3 if killed: their deletion skips the listing of
    open uploads (a request per region and checkpoint)."""
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 5 << 20, "m.json": b"{}"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        assert (await agent.wait_state("r", 1))["state"] == "durable"
        proxy.log.clear()
        detail, job = await delete_and_wait(agent, "r", 1)
        assert job["state"] == "succeeded", job
        assert detail["state"] == "deleted"
        deletes = [s for s in proxy.log if s.method == "DELETE"]
        assert len(deletes) == 3, deletes  # the manifest, then both files
        listed = [s for s in proxy.log if is_upload_listing(s)]
        assert not listed, listed
        left = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/r/")
        assert left.get("KeyCount", 0) == 0, left.get("Contents")


async def test_deleting_a_large_file_aborts_the_upload_left_open_under_it(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """A file larger than the smallest part may have been sent in parts: the
    multipart upload a killed agent left open under the checkpoint is found
    and aborted by its deletion."""
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": (5 << 20) + 1})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        assert (await agent.wait_state("r", 1))["state"] == "durable"
        step_prefix = f"{PREFIX}/r/step-{1:012d}/"
        s3_client.create_multipart_upload(Bucket=s3_bucket, Key=f"{step_prefix}rank-00000/w.bin")
        assert s3_client.list_multipart_uploads(Bucket=s3_bucket, Prefix=step_prefix).get("Uploads")
        proxy.log.clear()
        _detail, job = await delete_and_wait(agent, "r", 1)
        assert job["state"] == "succeeded", job
        assert any(is_upload_listing(s) for s in proxy.log), proxy.log
        open_uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket, Prefix=step_prefix)
        assert not open_uploads.get("Uploads"), open_uploads["Uploads"]


async def test_a_store_refusing_to_list_uploads_does_not_block_deletion(
    proxy: S3FaultProxy, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """A bucket policy without s3:ListBucketMultipartUploads: the deletion's
    clean-up of open uploads is refused (403), and the deletion still
    completes instead of retrying for ever (storage/leftovers.py)."""
    regions = [s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX)]
    async with running_agent(catalog(tmp_path), tmp_path, regions) as agent:
        # Larger than the smallest part: it may have been sent in parts, so
        # its deletion looks for open uploads.
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": 6 << 20})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        assert (await agent.wait_state("r", 1))["state"] == "durable"

        proxy.fail(403, "AccessDenied", only=lists_uploads)
        detail, job = await delete_and_wait(agent, "r", 1)
        assert job["state"] == "succeeded", job
        assert detail["state"] == "deleted"
        refused = proxy.faults()
        assert refused and all(s.method == "GET" and s.status == 403 for s in refused), refused
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"{PREFIX}/r/")
        assert listed.get("KeyCount", 0) == 0, listed.get("Contents")
