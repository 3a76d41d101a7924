"""Catalog rebuild (disaster recovery): a lost catalog is recreated from the
regions' MANIFEST.json objects, every object re-verified before anything is
called valid; on SQLite and PostgreSQL, with real SeaweedFS regions.

Two regions are two buckets of the session's SeaweedFS server (independent
namespaces, like two regions; a second server would cost ~10 s of start-up
for nothing the rebuild can tell apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import text

from devsupport import postgres as pg
from devsupport.agent import (
    make_settings,
    posix_region,
    running_agent,
    s3_region,
    write_checkpoint,
)
from devsupport.processes import cli, free_port, write_config
from devsupport.seaweed import SeaweedServer
from tierckpt.client.rebuild_report import render_report
from tierckpt.service.db import create_engine
from tierckpt.service.rebuild import rebuild
from tierckpt.service.storage.manifest import (
    InvalidManifest,
    ObjectEntry,
    build_manifest,
    parse_manifest,
)

RUN = "llm"
PREFIX = "prod"
TABLES = ("runs", "checkpoints", "shards", "files", "replicas", "jobs")


def key(step: int, rest: str) -> str:
    return f"{PREFIX}/{RUN}/step-{step:012d}/{rest}"


@pytest.fixture
def west_bucket(seaweed: SeaweedServer, s3_client: Any) -> Iterator[str]:
    name = seaweed.create_bucket(f"test-{uuid.uuid4().hex[:16]}")
    yield name
    if seaweed.running:
        with contextlib.suppress(Exception):
            s3_client.delete_bucket(Bucket=name)


@pytest.fixture
def rebuilt_url(catalog_url: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty catalog on the same backend: the lost one is not reused."""
    if catalog_url.startswith("sqlite"):
        yield f"sqlite+aiosqlite:///{tmp_path / 'rebuilt' / 'catalog.db'}"
        return
    url = pg.create_temp_database(pg.postgres_admin_url())
    try:
        yield url
    finally:
        pg.drop_database(url)


async def snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the catalog tables, to show a second rebuild changes nothing."""
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return {
                table: [
                    tuple(row)
                    for row in (await conn.execute(text(f"SELECT * FROM {table} ORDER BY id")))
                ]
                for table in TABLES
            }
    finally:
        await engine.dispose()


def files_of(checkpoint: dict[str, Any]) -> list[tuple[int, str, int, str]]:
    return sorted((f["rank"], f["path"], f["size"], f["sha256"]) for f in checkpoint["files"])


def object_sha256(s3_client: Any, bucket: str, object_key: str) -> str:
    return hashlib.sha256(
        s3_client.get_object(Bucket=bucket, Key=object_key)["Body"].read()
    ).hexdigest()


async def test_rebuild_catalog_from_manifests(
    catalog_url: str,
    rebuilt_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    s3_bucket: str,
    west_bucket: str,
    s3_client: Any,
) -> None:
    east = s3_region("east", seaweed.endpoint_url, s3_bucket, prefix=PREFIX)
    west = s3_region("west", seaweed.endpoint_url, west_bucket, prefix=PREFIX)
    ssd = tmp_path / "ssd"

    # -- a healthy catalog: three checkpoints, replicated to both regions ------
    original: dict[int, dict[str, Any]] = {}
    async with running_agent(catalog_url, tmp_path, [east, west], ssd=ssd) as agent:
        rank0 = write_checkpoint(ssd / RUN / "10" / "r0", {"model.bin": 300_000, "opt/s.pt": 999})
        rank1 = write_checkpoint(ssd / RUN / "10" / "r1", {"model.bin": 200_000})
        for rank, path in ((0, rank0), (1, rank1)):
            answer = await agent.register(RUN, 10, path, rank=rank, world_size=2)
            assert answer.status_code == 202, answer.text
        step20 = write_checkpoint(ssd / RUN / "20", {"model.bin": 100_000, "meta.json": b"{}"})
        answer = await agent.register(
            RUN,
            20,
            step20,
            epoch=3,
            metrics={"loss": 1.25, "acc": 0.5},
            metadata={"lr": 0.001, "tags": ["a", "b"]},
            parent={"run": RUN, "step": 10},
        )
        assert answer.status_code == 202, answer.text
        step30 = write_checkpoint(ssd / RUN / "30", {"model.bin": 50_000})
        answer = await agent.register(RUN, 30, step30, parent={"run": RUN, "step": 20})
        assert answer.status_code == 202, answer.text
        for step in (10, 20, 30):
            await agent.wait_state(RUN, step, ("replicated",))
            original[step] = (await agent.http.get(f"/v1/runs/{RUN}/checkpoints/{step}")).json()
    # ... and the catalog is lost: the rebuild writes into a fresh database.

    # -- damage in the regions -------------------------------------------------
    # step 30: a same-size garbage object in east; west never got its manifest.
    s3_client.put_object(
        Bucket=s3_bucket, Key=key(30, "rank-00000/model.bin"), Body=os.urandom(50_000)
    )
    s3_client.delete_object(Bucket=west_bucket, Key=key(30, "MANIFEST.json"))
    # step 10: east's manifest lies about one hash (its objects are intact);
    # west's manifest and objects agree, so west's content must win.
    manifest = json.loads(
        s3_client.get_object(Bucket=s3_bucket, Key=key(10, "MANIFEST.json"))["Body"].read()
    )
    lie = next(f for f in manifest["files"] if f["rank"] == 1)
    lie["sha256"] = "0" * 64
    s3_client.put_object(
        Bucket=s3_bucket,
        Key=key(10, "MANIFEST.json"),
        Body=json.dumps(manifest, indent=1, sort_keys=True).encode(),
    )
    # Not a manifest at all: reported, skipped.
    s3_client.put_object(
        Bucket=s3_bucket, Key=f"{PREFIX}/junk/step-000000000001/MANIFEST.json", Body=b"{nope"
    )
    # A region that cannot be reached: its root is under a regular file.
    (tmp_path / "not-a-dir").write_bytes(b"")
    broken = posix_region("broken", tmp_path / "not-a-dir" / "region")

    # -- rebuild (in-process) --------------------------------------------------
    settings = make_settings(rebuilt_url, ssd, [east, west, broken])
    report = await rebuild(settings)
    out = report.to_json()
    assert [r["region"] for r in out["regions_unreachable"]] == ["broken"]
    assert [(m["region"], m["key"]) for m in out["manifests_invalid"]] == [
        ("east", "junk/step-000000000001/MANIFEST.json")
    ]
    by_step = {c["step"]: c for c in out["checkpoints"]}
    assert sorted(by_step) == [10, 20, 30]
    assert all(c["run"] == RUN and c["action"] == "created" for c in by_step.values())

    c10 = by_step[10]["regions"]
    assert by_step[10]["state"] == "durable"
    assert c10["east"]["status"] == "corrupt" and c10["east"]["replica"] == "corrupt"
    assert "rank-00001/model.bin" in c10["east"]["error"]
    assert c10["west"] == {"status": "verified", "replica": "committed", "error": None}
    assert c10["broken"]["status"] == "unreachable" and c10["broken"]["replica"] == "pending"
    assert by_step[10]["jobs_enqueued"] == 2  # east repaired, broken filled, from west

    assert by_step[20]["state"] == "durable"  # 2 of 3 configured regions committed
    assert {n: r["status"] for n, r in by_step[20]["regions"].items()} == {
        "east": "verified",
        "west": "verified",
        "broken": "unreachable",
    }
    assert by_step[20]["jobs_enqueued"] == 1

    c30 = by_step[30]["regions"]
    assert by_step[30]["state"] == "corrupt"
    assert c30["east"]["status"] == "corrupt"
    assert f"{RUN}/step-000000000030/rank-00000/model.bin" in c30["east"]["error"]
    assert c30["west"] == {"status": "missing", "replica": "pending", "error": None}
    assert by_step[30]["jobs_enqueued"] == 0  # no intact copy to repair from

    assert out["totals"]["valid"] == 2 and out["totals"]["jobs_enqueued"] == 3
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_report(report))
    shown = console.export_text()
    assert "catalog rebuild" in shown and "region broken unreachable" in shown

    # -- the rebuilt catalog answers like the lost one -------------------------
    async with running_agent(
        rebuilt_url, tmp_path, [east, west], ssd=ssd, start_worker=False
    ) as agent:
        latest = (await agent.http.get(f"/v1/runs/{RUN}/latest")).json()
        assert latest["step"] == 20  # 30 is corrupt everywhere: never the answer
        assert [loc["region"] for loc in latest["locations"]] == ["east", "west"]
        rebuilt = {
            step: (await agent.http.get(f"/v1/runs/{RUN}/checkpoints/{step}")).json()
            for step in (10, 20, 30)
        }
    for step in (10, 20, 30):
        before, after = original[step], rebuilt[step]
        assert files_of(after) == files_of(before)
        for field in ("world_size", "epoch", "metrics", "metadata", "parent", "created_at"):
            assert after[field] == before[field], (step, field)
        assert after["total_bytes"] == before["total_bytes"]
        assert after["file_count"] == before["file_count"]
        assert [s["node"] for s in after["shards"]] == ["rebuilt"] * before["world_size"]
        assert {s["state"] for s in after["shards"]} == {"uploaded"}
    assert rebuilt[10]["world_size"] == 2 and rebuilt[10]["state"] == "durable"
    assert rebuilt[20]["metrics"] == {"loss": 1.25, "acc": 0.5}
    assert rebuilt[20]["parent"] == {"run": RUN, "step": 10}
    assert rebuilt[20]["children"] == [{"run": RUN, "step": 30}]
    replicas30 = {r["region"]: r for r in rebuilt[30]["replicas"]}
    assert replicas30["east"]["state"] == "corrupt"
    assert "rank-00000/model.bin" in replicas30["east"]["error"]
    assert replicas30["west"]["state"] == "pending"
    replicas20 = {r["region"]: r for r in rebuilt[20]["replicas"]}
    assert replicas20["east"]["state"] == replicas20["west"]["state"] == "committed"
    assert replicas20["east"]["verified_at"] is not None
    jobs = {(step, j["kind"], j["region"]) for step in (10, 20, 30) for j in rebuilt[step]["jobs"]}
    assert jobs == {
        (10, "replicate", "east"),
        (10, "replicate", "broken"),
        (20, "replicate", "broken"),
    }

    # -- a second rebuild, through the CLI, changes nothing --------------------
    before = await snapshot(rebuilt_url)
    config = write_config(
        tmp_path / "rebuild.toml",
        {"server": {"node": "ops"}, "catalog": {"url": rebuilt_url}},
        [east, west, broken],
    )
    done = await asyncio.to_thread(cli, "rebuild-catalog", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert [(c["step"], c["action"]) for c in again["checkpoints"]] == [
        (10, "unchanged"),
        (20, "unchanged"),
        (30, "unchanged"),
    ]
    assert again["totals"]["jobs_enqueued"] == 0
    assert again["manifests_invalid"][0]["key"] == "junk/step-000000000001/MANIFEST.json"
    assert await snapshot(rebuilt_url) == before

    # -- the service repairs what the rebuild queued ---------------------------
    async with running_agent(rebuilt_url, tmp_path, [east, west], ssd=ssd) as agent:
        repaired = await agent.wait_state(RUN, 10, ("replicated",), timeout=30)
    states = {r["region"]: r["state"] for r in repaired["replicas"]}
    assert states == {"east": "committed", "west": "committed", "broken": "pending"}
    for rank, path, _size, sha256 in files_of(original[10]):
        assert object_sha256(s3_client, s3_bucket, key(10, f"rank-{rank:05d}/{path}")) == sha256
    # The manifest the repair wrote from the rebuilt catalog is byte for byte
    # the one the original commit wrote (created_at, metrics... round-trip).
    assert object_sha256(s3_client, s3_bucket, key(10, "MANIFEST.json")) == object_sha256(
        s3_client, west_bucket, key(10, "MANIFEST.json")
    )


async def test_rebuild_catalog_exit_codes(tmp_path: Path) -> None:
    """2: bad configuration; 3: every region (or the catalog) unreachable."""
    catalog = {"url": f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"}
    (tmp_path / "file").write_bytes(b"")
    broken = posix_region("broken", tmp_path / "file" / "region")

    bad = write_config(tmp_path / "bad.toml", {"catalog": catalog}, [{"name": "x", "kind": "s3"}])
    unreachable = write_config(tmp_path / "down.toml", {"catalog": catalog}, [broken])
    no_catalog = write_config(
        tmp_path / "nodb.toml",
        {"catalog": {"url": f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none"}},
        [posix_region("ok", tmp_path / "ok")],
    )
    results = await asyncio.gather(
        *(
            asyncio.to_thread(cli, "rebuild-catalog", "--config", str(path), "--json")
            for path in (bad, unreachable, no_catalog)
        )
    )
    bad_run, down_run, nodb_run = results
    assert bad_run.returncode == 2 and "needs a bucket" in bad_run.stderr
    assert down_run.returncode == 3, down_run.stderr
    assert "no region could be reached" in down_run.stderr
    assert json.loads(down_run.stdout)["regions_unreachable"][0]["region"] == "broken"
    assert nodb_run.returncode == 3 and "catalog" in nodb_run.stderr
    assert "Traceback" not in bad_run.stderr + down_run.stderr + nodb_run.stderr


def _manifest(**changes: Any) -> bytes:
    document = json.loads(
        build_manifest(
            run=RUN,
            step=7,
            world_size=2,
            epoch=None,
            parent={"run": RUN, "step": 6},
            metrics={"loss": 1.0},
            metadata={},
            created_at=datetime(2024, 5, 1, 12, 0, 0, 123456),
            files=[
                ObjectEntry.of(RUN, 7, 0, "a/b.bin", 3, "a" * 64),
                ObjectEntry.of(RUN, 7, 1, "c", 0, "b" * 64),
            ],
        )
    )
    document.update(changes)
    return json.dumps(document).encode()


def test_manifest_checks() -> None:
    """What the rebuild accepts from a MANIFEST.json, and what it reports as invalid."""
    good = parse_manifest(_manifest(), RUN, 7)
    assert good.world_size == 2 and good.parent == (RUN, 6)
    assert good.created_at == datetime(2024, 5, 1, 12, 0, 0, 123456)
    assert [(e.rank, e.path) for e in good.files] == [(0, "a/b.bin"), (1, "c")]
    file = {"rank": 0, "path": "x", "size": 1, "sha256": "c" * 64}
    for data, why in [
        (b"{nope", "not a tierckpt manifest"),
        (b"[]", "not a tierckpt manifest"),
        (_manifest(format="other/1"), "not a tierckpt manifest"),
        (_manifest(step=8), "stored under"),
        (_manifest(world_size=0), "world_size"),
        (_manifest(files=[{**file, "rank": 2}]), "not below world_size"),
        (_manifest(files=[{**file, "path": "../escape"}]), "safe relative path"),
        (_manifest(files=[{**file, "path": "/abs"}]), "safe relative path"),
        (_manifest(files=[{**file, "sha256": "C" * 64}]), "sha256"),
        (_manifest(files=[{**file, "size": -1}]), "size"),
        (_manifest(files=[file, file]), "listed twice"),
        (_manifest(metrics={"loss": "low"}), "finite number"),
        (_manifest(created_at="yesterday"), "created_at"),
        (_manifest(parent={"run": "a/b", "step": 1}), "parent"),
    ]:
        with pytest.raises(InvalidManifest, match=why):
            parse_manifest(data, RUN, 7)
