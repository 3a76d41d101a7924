"""Restore: ranged parallel download, SHA-256 verification, region fallback,
atomic placement and path confinement."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path, PurePosixPath

import pytest

from tierckpt.client import (
    AsyncCheckpointClient,
    CheckpointClient,
    ConflictError,
    DestinationError,
    NotFoundError,
    RestoreError,
    TransferOptions,
)
from tierckpt.client.models import PlanFile
from tierckpt.client.restore import plan_layout

try:
    from test_client_fakeapi import BASE_URL, FakeApi
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi

RANGE = 1000
SMALL = TransferOptions(range_size=RANGE, concurrency=4, window=8, retries=1, retry_backoff=0.001)


def blob(size: int, seed: int = 0) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}-{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


FILES = {
    "model/weights.bin": blob(10 * RANGE + 500, 1),  # 11 ranges
    "optim/state.bin": blob(3 * RANGE, 2),  # exactly 3 ranges
    "empty.txt": b"",
    "données/模型-ü.json": b'{"epoch": 3}',
}


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tierckpt-partial-" in p.name)


@pytest.fixture
def fake() -> FakeApi:
    fake = FakeApi(token="tok")
    fake.add_checkpoint("llama", 100, FILES)
    return fake


def async_client(fake: FakeApi, **kwargs) -> AsyncCheckpointClient:
    return AsyncCheckpointClient(
        BASE_URL, token="tok", transport=fake.async_transport(), transfer=SMALL, **kwargs
    )


async def test_restore_downloads_ranges_in_parallel_and_verifies(fake, tmp_path):
    dest = tmp_path / "restored"
    seen: list[tuple[int, int]] = []
    async with async_client(fake) as client:
        result = await client.restore(
            "llama", dest, step=100, progress=lambda d, t: seen.append((d, t))
        )
    assert result == dest
    assert tree(dest) == FILES
    ranges = [r.headers["range"] for r in fake.object_requests("east")]
    assert len(ranges) == 11 + 3 + 1  # no request at all for the empty file
    assert "bytes=10000-10499" in ranges
    assert 1 < fake.max_in_flight <= SMALL.concurrency
    # The service's own object endpoint gets the token.
    assert {r.headers["authorization"] for r in fake.object_requests("east")} == {"Bearer tok"}
    assert not fake.object_requests("west")
    total = sum(map(len, FILES.values()))
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert leftovers(tmp_path) == []


async def test_ranges_finishing_out_of_order_still_hash_right(fake, tmp_path):
    # Later ranges answer first, so the in-order hash has to wait for them.
    def delay(request) -> float:
        header = request.headers.get("range", "bytes=0-0")
        start = int(header.split("=")[1].split("-")[0])
        return max(0.0, 0.02 - start / 1_000_000)

    fake.delay = delay
    async with async_client(fake) as client:
        await client.restore("llama", tmp_path / "d", step=100)
    assert tree(tmp_path / "d") == FILES


async def test_presigned_urls_get_no_token(fake, tmp_path):
    async with async_client(fake) as client:
        await client.restore("llama", tmp_path / "d", step=100, region="west")
    assert tree(tmp_path / "d") == FILES
    west = fake.object_requests("west")
    assert west and all("authorization" not in r.headers for r in west)
    assert not fake.object_requests("east")


async def test_hash_mismatch_falls_back_and_keeps_verified_files(fake, tmp_path, caplog):
    bad_name = "données/模型-ü.json"
    fake.corrupt.add(("east", fake.key_of("llama", 100, bad_name)))
    # The bad file answers last, so every other file is verified by then.
    fake.delay = lambda request: 0.05 if "json" in request.url.path else 0.001
    caplog.set_level(logging.WARNING, logger="tierckpt.client.restore")
    async with async_client(fake) as client:
        await client.restore("llama", tmp_path / "d", step=100)
    assert tree(tmp_path / "d") == FILES
    assert "SHA-256 mismatch" in caplog.text and "east" in caplog.text and "west" in caplog.text
    # Files east already delivered intact are not fetched again.
    refetched = {r.url.path.split("/rank-00000/")[1] for r in fake.object_requests("west")}
    assert refetched == {bad_name}
    assert leftovers(tmp_path) == []


async def test_transient_errors_are_retried_within_a_source(fake, tmp_path):
    fake.flaky["east"] = 1
    async with async_client(fake) as client:
        await client.restore("llama", tmp_path / "d", step=100)
    assert tree(tmp_path / "d") == FILES
    assert not fake.object_requests("west")


async def test_a_source_ignoring_range_is_abandoned(fake, tmp_path):
    fake.ignore_range.add("east")
    async with async_client(fake) as client:
        await client.restore("llama", tmp_path / "d", step=100)
    assert tree(tmp_path / "d") == FILES
    assert fake.object_requests("west")


async def test_every_source_bad_leaves_nothing(fake, tmp_path):
    fake.corrupt.add(("east", fake.key_of("llama", 100, "optim/state.bin")))
    fake.broken["west"] = 403
    dest = tmp_path / "new" / "parents" / "d"
    async with async_client(fake) as client:
        with pytest.raises(RestoreError) as caught:
            await client.restore("llama", dest, step=100)
    assert caught.value.code == "all_sources_failed"
    assert "east: SHA-256 mismatch" in caught.value.message
    assert "west:" in caught.value.message and "403" in caught.value.message
    assert list(tmp_path.iterdir()) == []


async def test_cancelled_restore_leaves_nothing(fake, tmp_path):
    downloading = asyncio.Event()

    def delay(request) -> float:
        if "/objects/" in request.url.path:
            downloading.set()
        return 0.05

    fake.delay = delay
    async with async_client(fake) as client:
        task = asyncio.create_task(client.restore("llama", tmp_path / "d", step=100))
        await asyncio.wait_for(downloading.wait(), timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert list(tmp_path.iterdir()) == []


async def test_non_empty_destination_is_refused_before_downloading(fake, tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    async with async_client(fake) as client:
        with pytest.raises(DestinationError, match="not empty"):
            await client.restore("llama", dest, step=100)
        (tmp_path / "file").write_text("x")
        with pytest.raises(DestinationError, match="not a directory"):
            await client.restore("llama", tmp_path / "file", step=100)
    assert not fake.object_requests("east")
    assert (dest / "keep.txt").read_text() == "mine"
    assert isinstance(DestinationError("x"), RestoreError)


async def test_empty_destination_directory_is_replaced(fake, tmp_path):
    dest = tmp_path / "d"
    dest.mkdir(mode=0o750)
    os.chmod(dest, 0o750)
    async with async_client(fake) as client:
        await client.restore("llama", dest, step=100)
    assert tree(dest) == FILES
    assert dest.stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize("bad", ["../escape.bin", "a/../../b", "/etc/passwd", ""])
async def test_unsafe_plan_paths_are_refused(fake, tmp_path, bad):
    fake.plan_override = {
        "run": "llama",
        "step": 100,
        "world_size": 1,
        "sources": [
            {
                "region": "east",
                "files": [
                    {"rank": 0, "path": "ok.bin", "size": 1, "sha256": "00" * 32, "url": "/x"},
                    {"rank": 0, "path": bad, "size": 1, "sha256": "00" * 32, "url": "/y"},
                ],
            }
        ],
    }
    async with async_client(fake) as client:
        with pytest.raises(RestoreError) as caught:
            await client.restore("llama", tmp_path / "sub" / "d", step=100)
    assert caught.value.code == "unsafe_path"
    assert not [r for r in fake.requests if r.url.path in ("/x", "/y")]
    assert not (tmp_path / "escape.bin").exists()
    assert list(tmp_path.iterdir()) == []


def test_sync_client_restores_latest_by_default(tmp_path):
    fake = FakeApi()
    fake.add_checkpoint("llama", 100, {"a.bin": blob(2500)})
    fake.add_checkpoint("llama", 200, {"a.bin": blob(2500, 7)})
    with CheckpointClient(BASE_URL, transport=fake.transport(), transfer=SMALL) as client:
        path = client.restore("llama", tmp_path / "d")
    assert path == tmp_path / "d"
    assert tree(path) == {"a.bin": blob(2500, 7)}


async def test_sync_client_restore_works_inside_a_running_loop(tmp_path):
    fake = FakeApi()
    fake.add_checkpoint("llama", 1, {"a.bin": blob(1500)})
    with CheckpointClient(BASE_URL, transport=fake.transport(), transfer=SMALL) as client:
        client.restore("llama", tmp_path / "d", step=1)
    assert tree(tmp_path / "d") == {"a.bin": blob(1500)}


async def test_restore_errors_from_the_plan(tmp_path):
    fake = FakeApi()
    fake.add_checkpoint("llama", 1, {"a.bin": b"x"}, state="uploading")
    async with async_client(fake) as client:
        with pytest.raises(NotFoundError):
            await client.restore("llama", tmp_path / "d")  # no valid checkpoint
        with pytest.raises(ConflictError):
            await client.restore("llama", tmp_path / "d", step=1)  # not durable yet
    assert list(tmp_path.iterdir()) == []


# -- rank layout ----------------------------------------------------------------


def test_colliding_rank_paths_get_rank_directories(tmp_path):
    fake = FakeApi()
    shards = {(0, "model.bin"): blob(1200, 0), (1, "model.bin"): blob(1300, 1)}
    fake.add_checkpoint("llama", 1, shards)
    with CheckpointClient(BASE_URL, transport=fake.transport(), transfer=SMALL) as client:
        client.restore("llama", tmp_path / "all", step=1)
        client.restore("llama", tmp_path / "one", step=1, rank=1)
    assert tree(tmp_path / "all") == {
        "rank-00000/model.bin": blob(1200, 0),
        "rank-00001/model.bin": blob(1300, 1),
    }
    assert tree(tmp_path / "one") == {"model.bin": blob(1300, 1)}


def test_distinct_rank_paths_restore_flat(tmp_path):
    fake = FakeApi()
    fake.add_checkpoint("llama", 1, {(0, "shard-0.bin"): b"zero", (1, "shard-1.bin"): b"one"})
    with CheckpointClient(BASE_URL, transport=fake.transport(), transfer=SMALL) as client:
        client.restore("llama", tmp_path / "d", step=1)
    assert tree(tmp_path / "d") == {"shard-0.bin": b"zero", "shard-1.bin": b"one"}


def plan_file(rank: int, path: str) -> PlanFile:
    return PlanFile(rank=rank, path=path, size=0, sha256="0" * 64, url="/u")


def test_plan_layout_rules():
    files = [plan_file(0, "a/x"), plan_file(1, "a/x"), plan_file(1, "b")]
    rels = [rel for _, rel in plan_layout(files, None)]
    assert rels == [
        PurePosixPath("rank-00000/a/x"),
        PurePosixPath("rank-00001/a/x"),
        PurePosixPath("rank-00001/b"),
    ]
    assert [rel for _, rel in plan_layout(files, 1)] == [PurePosixPath("a/x"), PurePosixPath("b")]
    with pytest.raises(RestoreError, match="both a file and a directory"):
        plan_layout([plan_file(0, "a"), plan_file(0, "a/b")], None)
    with pytest.raises(RestoreError, match="no SHA-256"):
        plan_layout([PlanFile(rank=0, path="a", size=1, sha256=None, url="/u")], None)
