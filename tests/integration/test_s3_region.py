"""Uploads to a real SeaweedFS S3 region, read back independently with boto3."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from botocore.endpoint_provider import RuleSet

from devsupport.agent import (
    AgentOrNetwork,
    posix_region,
    running_agent,
    s3_region,
    write_checkpoint,
)
from devsupport.seaweed import SeaweedServer
from tierckpt.client import AsyncCheckpointClient
from tierckpt.service.config import RegionSettings
from tierckpt.service.storage.factory import build_store


def object_sha256(s3_client: Any, bucket: str, key: str) -> str:
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
    digest = hashlib.sha256()
    for chunk in iter(lambda: body.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


async def test_multipart_upload_to_s3_and_presigned_restore(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    region = s3_region("east", seaweed.endpoint_url, s3_bucket)
    async with running_agent(catalog_url, tmp_path, [region]) as agent:
        # 5 MiB parts: the 23 MiB file goes up as 5 parallel parts.
        ckpt = write_checkpoint(
            agent.ssd / "llm" / "step-3",
            {"shard.bin": 23 << 20, "a/b/c.json": b"{}", "empty": b"", "ünï.txt": b"u"},
        )
        assert (await agent.register("llm", 3, ckpt, metrics={"loss": 1.5})).status_code == 202
        done = await agent.wait_state("llm", 3)
        assert done["replicas"][0]["uri"] == f"s3://{s3_bucket}/prod/llm/step-000000000003/"

        prefix = "prod/llm/step-000000000003/"
        listed = {
            o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)["Contents"]
        }
        assert listed == {
            prefix + "MANIFEST.json",
            *(prefix + "rank-00000/" + p for p in ("shard.bin", "a/b/c.json", "empty", "ünï.txt")),
        }
        for entry in done["files"]:
            local = hashlib.sha256((ckpt / entry["path"]).read_bytes()).hexdigest()
            remote = object_sha256(s3_client, s3_bucket, prefix + "rank-00000/" + entry["path"])
            assert local == remote == entry["sha256"]

        # The client restores straight from S3 through presigned ranged GETs.
        plan = (await agent.http.get("/v1/runs/llm/checkpoints/3/download")).json()
        assert plan["sources"][0]["files"][0]["url"].startswith(seaweed.endpoint_url)
        transport = AgentOrNetwork(agent.http._transport)
        async with AsyncCheckpointClient("http://agent", transport=transport) as client:
            dest = await client.restore("llm", tmp_path / "restored")
        for entry in done["files"]:
            assert (
                hashlib.sha256((dest / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
            )


@pytest.mark.parametrize("kind", ["s3", "posix"])
async def test_abort_incomplete_clears_only_its_prefix(
    kind: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    """What a killed upload leaves (an open multipart upload: S3 parts, or a
    POSIX temporary file) is found and aborted under one shard's prefix;
    another shard's open upload and the finished objects are left alone."""
    settings = (
        s3_region("east", seaweed.endpoint_url, s3_bucket)
        if kind == "s3"
        else posix_region("east", tmp_path / "region")
    )
    store = build_store(RegionSettings.model_validate(settings))
    try:
        await store.ensure_ready()
        mine, other = "r/step-000000000001/rank-00000/", "r/step-000000000001/rank-00001/"
        await store.put_bytes(mine + "done.bin", b"kept")
        left = [await store.create_multipart(mine + name) for name in ("a.bin", "deep/b.bin")]
        await store.upload_part(left[0], 1, 0, b"x" * (5 << 20))
        theirs = await store.create_multipart(other + "c.bin")

        assert await store.abort_incomplete(mine) == 2
        assert await store.abort_incomplete(mine) == 0
        assert [o.key async for o in store.list("r/")] == [mine + "done.bin"]
        # The other shard's upload is still open and completes.
        part = await store.upload_part(theirs, 1, 0, b"theirs")
        await store.complete_multipart(theirs, [part])
        assert await store.get_range(other + "c.bin", 0, 6) == b"theirs"
        assert await store.abort_incomplete("nothing/here/") == 0
    finally:
        await store.aclose()


async def test_requests_for_new_keys_resolve_the_endpoint_once(
    seaweed: SeaweedServer, s3_bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3's rule set is evaluated for the first request, then botocore's cache
    answers every other key's (storage/s3_endpoints.py); the objects land
    where they should."""
    evaluations: list[dict[str, Any]] = []
    evaluate = RuleSet.evaluate

    def counted(self: RuleSet, input_parameters: dict[str, Any]) -> Any:
        evaluations.append(dict(input_parameters))
        return evaluate(self, input_parameters)

    monkeypatch.setattr(RuleSet, "evaluate", counted)
    store = build_store(
        RegionSettings.model_validate(s3_region("east", seaweed.endpoint_url, s3_bucket))
    )
    try:
        for n in range(8):
            await store.put_bytes(f"r/step-{n}/w.bin", b"w%d" % n)
            assert await store.head(f"r/step-{n}/w.bin") is not None
        await store.delete("r/step-0/w.bin")
    finally:
        await store.aclose()
    assert len(evaluations) == 1 and "Key" not in evaluations[0]
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == [f"prod/r/step-{n}/w.bin" for n in range(1, 8)]
