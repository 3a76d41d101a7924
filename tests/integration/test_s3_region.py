"""Uploads to a real SeaweedFS S3 region, read back independently with boto3."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tests.support.agent import AgentOrNetwork, running_agent, s3_region, write_checkpoint
from tests.support.seaweed import SeaweedServer
from tierckpt.client import AsyncCheckpointClient


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
