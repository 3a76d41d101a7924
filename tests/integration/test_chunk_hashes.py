"""Chunk hashes end to end (real agent, real SeaweedFS, both catalogs): the
upload hashes every chunk in its single read, for sent and dedup-copied
files alike; the catalog, the manifest and the restore plan (?chunks=true)
carry them, and each one is the SHA-256 of those bytes of the stored object."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from devsupport.agent import running_agent, s3_region, write_checkpoint
from devsupport.seaweed import SeaweedServer

MiB = 1024 * 1024
# 5 MiB parts, 2 MiB chunks: parts and chunks straddle each other's edges.
FILES = {"w.bin": 11 * MiB + 123, "small.json": 77, "empty": b""}


def chunk_digests(data: bytes, size: int) -> list[str]:
    return [hashlib.sha256(data[i : i + size]).hexdigest() for i in range(0, len(data), size)]


async def test_chunk_hashes_in_catalog_manifest_and_plan(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    region = s3_region("east", seaweed.endpoint_url, s3_bucket, prefix="p")
    async with running_agent(
        catalog_url, tmp_path, [region], upload={"part_size_mb": 5, "chunk_size_mb": 2}
    ) as agent:
        first = write_checkpoint(agent.ssd / "step-1", dict(FILES))
        # Step 2 copies the big file byte for byte: dedup copies it server-side
        # and must still record its chunks.
        second = agent.ssd / "step-2"
        second.mkdir()
        for name in FILES:
            shutil.copyfile(first / name, second / name)
        for step, path in ((1, first), (2, second)):
            answer = await agent.register("llm", step, path)
            assert answer.status_code == 202, answer.text
            assert (await agent.wait_state("llm", step))["state"] == "durable"

            plan = (
                await agent.http.get(f"/v1/runs/llm/checkpoints/{step}/download?chunks=true")
            ).json()
            manifest = json.loads(
                s3_client.get_object(Bucket=s3_bucket, Key=f"p/llm/step-{step:012d}/MANIFEST.json")[
                    "Body"
                ].read()
            )
            listed = {f["path"]: f for f in manifest["files"]}
            for entry in plan["sources"][0]["files"]:
                stored = s3_client.get_object(
                    Bucket=s3_bucket, Key=f"p/llm/step-{step:012d}/rank-00000/{entry['path']}"
                )["Body"].read()
                expected = chunk_digests(stored, 2 * MiB)
                assert entry["chunk_size"] == 2 * MiB, entry["path"]
                assert entry["chunk_sha256"] == expected, entry["path"]
                assert listed[entry["path"]]["chunk_sha256"] == expected
                assert listed[entry["path"]]["chunk_size"] == 2 * MiB
            assert (
                len(listed["w.bin"]["chunk_sha256"]) == 6 and listed["empty"]["chunk_sha256"] == []
            )

        # Without ?chunks the plan stays as it was (no hashes to send).
        plain = (await agent.http.get("/v1/runs/llm/checkpoints/1/download")).json()
        assert all(f["chunk_sha256"] is None for f in plain["sources"][0]["files"])


async def test_chunk_hashes_off(catalog_url: str, tmp_path: Path) -> None:
    """[upload] chunk_size_mb = 0: whole-file hashes only; the manifest and
    the plan then look as before chunk hashes existed (readers verify whole
    files)."""
    async with running_agent(catalog_url, tmp_path, upload={"chunk_size_mb": 0}) as agent:
        path = write_checkpoint(agent.ssd / "step-1", {"w.bin": 3 * MiB})
        assert (await agent.register("off", 1, path)).status_code == 202
        assert (await agent.wait_state("off", 1))["state"] == "durable"
        plan = (await agent.http.get("/v1/runs/off/checkpoints/1/download?chunks=true")).json()
        (entry,) = plan["sources"][0]["files"]
        assert entry["chunk_size"] is None and entry["chunk_sha256"] is None
        region = agent.settings.regions[0]
        manifest = json.loads(
            (Path(region.root) / "off" / "step-000000000001" / "MANIFEST.json").read_bytes()
        )
        assert set(manifest["files"][0]) == {"rank", "path", "size", "sha256"}
