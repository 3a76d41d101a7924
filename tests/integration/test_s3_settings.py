"""Production S3 settings per region — server-side encryption, storage class,
hashed key prefix — against a real SeaweedFS, through the proxy that records
each request's x-amz-* headers.

Every object tierckpt writes (PUT, multipart upload, server-side copy into a
second region) asks for the region's encryption and class; a hashed region
stores each rank's objects under its partition segment, its manifest says so
(``key_layout``), and restore, verify and a catalog rebuild all find them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devsupport.agent import AgentOrNetwork, running_agent, s3_region, write_checkpoint
from devsupport.s3proxy import S3FaultProxy, Seen
from devsupport.seaweed import SeaweedServer
from tierckpt.client import AsyncCheckpointClient
from tierckpt.service.config import RegionSettings, Settings
from tierckpt.service.rebuild.runner import rebuild
from tierckpt.service.storage import layout

PREFIX = "prod"
RUN = "llm"


@pytest.fixture
def west_bucket(seaweed: SeaweedServer) -> str:
    return seaweed.create_bucket(f"west-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def proxy(seaweed: SeaweedServer) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(seaweed.endpoint_url) as running:
        yield running


def writes(log: list[Seen]) -> dict[str, list[Seen]]:
    """The requests that create an object, by S3 operation."""
    kinds: dict[str, list[Seen]] = {"put": [], "create_multipart": [], "copy": []}
    for seen in log:
        headers = dict(seen.amz)
        if seen.method == "POST" and seen.query == "uploads":
            kinds["create_multipart"].append(seen)
        elif seen.method == "PUT" and "partNumber" not in seen.query and seen.query != "":
            continue  # bucket sub-resources
        elif seen.method == "PUT" and "partNumber" not in seen.query:
            kinds["copy" if "x-amz-copy-source" in headers else "put"].append(seen)
    return kinds


async def test_encryption_class_and_hashed_prefix_reach_the_store(
    tmp_path: Path,
    proxy: S3FaultProxy,
    s3_bucket: str,
    west_bucket: str,
    s3_client: Any,
) -> None:
    settings = {"sse": "AES256", "storage_class": "STANDARD_IA", "hashed_prefix": True}
    east = {**s3_region("east", proxy.endpoint_url, s3_bucket, PREFIX), **settings}
    # Same endpoint: west is filled by server-side copies (CopyObject).
    west = {**s3_region("west", proxy.endpoint_url, west_bucket, PREFIX), **settings}
    catalog = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    async with running_agent(
        catalog, tmp_path, [east, west], upload={"part_size_mb": 5, "fan_out": False}
    ) as agent:
        files = {"model.bin": 12 << 20, "opt/state.bin": 3000, "meta.json": b"{}"}
        ranks = {
            rank: write_checkpoint(agent.ssd / RUN / "s7" / f"r{rank}", files) for rank in (0, 1)
        }
        for rank, path in ranks.items():
            answer = await agent.register(RUN, 7, path, rank=rank, world_size=2)
            assert answer.status_code == 202, answer.text
        done = await agent.wait_state(RUN, 7, ("replicated",))

        # -- every object written asked for the region's encryption and class --
        seen = writes(proxy.log)
        assert seen["put"] and seen["create_multipart"] and seen["copy"], {
            k: len(v) for k, v in seen.items()
        }
        for operation, requests in seen.items():
            for request in requests:
                headers = dict(request.amz)
                assert headers.get("x-amz-server-side-encryption") == "AES256", (operation, request)
                assert headers.get("x-amz-storage-class") == "STANDARD_IA", (operation, request)

        # -- the bucket's layout: data under each rank's partition, manifest not -
        step = f"{RUN}/step-000000000007"
        for bucket in (s3_bucket, west_bucket):
            keys = {
                o["Key"]
                for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/")["Contents"]
            }
            expected = {f"{PREFIX}/{step}/MANIFEST.json"}
            for rank in (0, 1):
                rank_key = f"{step}/rank-{rank:05d}/"
                segment = layout.partition(rank_key + "x")
                assert segment is not None and len(segment) == 4
                expected |= {f"{PREFIX}/{segment}/{rank_key}{p}" for p in files}
            assert keys == expected, bucket
            manifest = json.loads(
                s3_client.get_object(Bucket=bucket, Key=f"{PREFIX}/{step}/MANIFEST.json")[
                    "Body"
                ].read()
            )
            assert manifest["key_layout"] == layout.HASHED_LAYOUT
        uris = {r["region"]: r["uri"] for r in done["replicas"]}
        assert uris["east"] == f"s3://{s3_bucket}/{PREFIX}/{step}/"

        # -- restore (presigned ranged GETs) and verify find every object ------
        transport = AgentOrNetwork(agent.http._transport)
        async with AsyncCheckpointClient("http://agent", transport=transport) as client:
            dest = await client.restore(RUN, tmp_path / "restored")
            verified = await client.verify(RUN, 7, timeout=60)
        for rank, path in ranks.items():
            for relative in files:
                restored = dest / f"rank-{rank:05d}" / relative
                assert restored.read_bytes() == (path / relative).read_bytes()
        assert {r.region: r.state for r in verified.replicas} == {
            "east": "committed",
            "west": "committed",
        }
        assert all(r.verified_at is not None for r in verified.replicas)

    # -- a lost catalog is rebuilt from the hashed regions ------------------
    regions = [RegionSettings.model_validate(r) for r in (east, west)]
    rebuilt = Settings(
        catalog={"url": f"sqlite+aiosqlite:///{tmp_path / 'rebuilt.db'}"},
        local={"roots": [str(tmp_path / "ssd")]},
        regions=regions,
    )
    report = await rebuild(rebuilt)
    assert [(c.run, c.step, c.state) for c in report.checkpoints] == [(RUN, 7, "replicated")]
    assert all(r.status == "verified" for r in report.checkpoints[0].regions.values())

    # A region configured plain that holds hashed copies: no verdict of
    # corruption, and the report says what to set.
    plain = Settings(
        catalog={"url": f"sqlite+aiosqlite:///{tmp_path / 'plain.db'}"},
        local={"roots": [str(tmp_path / "ssd")]},
        regions=[RegionSettings.model_validate({**east, "hashed_prefix": False})],
    )
    report = await rebuild(plain)
    (checkpoint,) = report.checkpoints
    east_result = checkpoint.regions["east"]
    assert east_result.status == "unverified" and "hashed_prefix" in (east_result.error or "")


def test_s3_settings_are_checked() -> None:
    base = s3_region("east", "http://127.0.0.1:1", "b")
    with pytest.raises(ValueError, match="GLACIER"):
        RegionSettings.model_validate({**base, "storage_class": "GLACIER"})
    with pytest.raises(ValueError, match='needs sse = "aws:kms"'):
        RegionSettings.model_validate({**base, "sse_kms_key_id": "alias/ckpt"})
    with pytest.raises(ValueError, match="are S3 settings"):
        RegionSettings.model_validate(
            {"name": "local", "kind": "posix", "root": "/tmp/x", "hashed_prefix": True}
        )
    kms = RegionSettings.model_validate({**base, "sse": "aws:kms", "sse_kms_key_id": "alias/c"})
    assert kms.sse_kms_key_id == "alias/c"
