"""Prefetch before a restart: two in-process agents (two nodes) on one catalog
and real POSIX regions. A checkpoint written on node A is brought into node
B's T0 by B's agent, verified; B's `latest?node=` offers it; a second
prefetch reads nothing; a corrupt region is skipped for the next; the copies
count in T0 retention; bad requests are refused by name."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from devsupport.agent import Agent, posix_region, running_agent, write_checkpoint
from tierckpt.client import AsyncCheckpointClient, RestoreError
from tierckpt.service.db import transaction
from tierckpt.service.models import Job, utcnow
from tierckpt.service.prefetch import copies
from tierckpt.service.retention.service import apply_all

RUN = "r"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@asynccontextmanager
async def two_nodes(
    catalog_url: str, tmp_path: Path, regions: list[dict[str, Any]], **sections: Any
) -> AsyncIterator[tuple[Agent, Agent]]:
    async with AsyncExitStack() as stack:
        agents = [
            await stack.enter_async_context(
                running_agent(
                    catalog_url,
                    tmp_path / name,
                    regions,
                    ssd=tmp_path / f"ssd-{name}",
                    server={"node": name},
                    **sections,
                )
            )
            for name in ("node-a", "node-b")
        ]
        yield agents[0], agents[1]


async def save_on(agent: Agent, step: int, world_size: int = 2) -> dict[int, Path]:
    """A checkpoint of ``world_size`` ranks, every rank written and registered on ``agent``."""
    ranks = {}
    for rank in range(world_size):
        ranks[rank] = write_checkpoint(
            agent.ssd / f"step-{step}" / f"rank-{rank}",
            {f"shard-{rank}.bin": (1 << 20) + 7 * rank + step, "meta/info.json": b"{}"},
        )
        answer = await agent.register(RUN, step, ranks[rank], rank=rank, world_size=world_size)
        assert answer.status_code == 202, answer.text
    return ranks


async def prefetched(agent: Agent, body: dict[str, Any]) -> dict[str, Any]:
    """POST a prefetch through ``agent`` and wait for its jobs to end."""
    answer = await agent.http.post(f"/v1/runs/{RUN}/prefetch", json=body)
    assert answer.status_code == 202, answer.text
    out: dict[str, Any] = answer.json()
    ids = {job["id"] for job in out["jobs"]}
    for _ in range(1200):
        page = (await agent.http.get(f"/v1/runs/{RUN}/prefetch")).json()
        mine = [job for job in page["jobs"] if job["id"] in ids]
        if all(job["state"] in ("succeeded", "failed") for job in mine):
            out["jobs"] = mine
            return out
        await asyncio.sleep(0.05)
    raise AssertionError(f"prefetch still running: {mine}")


async def local_of(agent: Agent, node: str) -> dict[str, Any] | None:
    answer = await agent.http.get(f"/v1/runs/{RUN}/latest", params={"node": node})
    assert answer.status_code == 200, answer.text
    local: dict[str, Any] | None = answer.json()["local"]
    return local


async def test_prefetch_brings_a_sharded_checkpoint_into_another_node(
    catalog_url: str, tmp_path: Path
) -> None:
    region = tmp_path / "region-east"
    async with two_nodes(catalog_url, tmp_path, [posix_region("east", region)]) as (a, b):
        ranks = await save_on(a, 10)
        await a.wait_state(RUN, 10)
        assert await local_of(b, "node-b") is None  # B holds nothing yet

        out = await prefetched(b, {"nodes": ["node-b"]})
        assert out["step"] == 10
        assert [(j["node"], j["state"], j["error"]) for j in out["jobs"]] == [
            ("node-b", "succeeded", None)
        ]
        local = await local_of(b, "node-b")
        assert local is not None and local["node"] == "node-b"
        copy = copies.step_dir(b.settings, RUN, 10)
        assert local["ranks"] == {str(r): str(copies.rank_dir(copy, r)) for r in (0, 1)}
        assert local["path"] == local["ranks"]["0"]
        for rank, source in ranks.items():
            for file in (f"shard-{rank}.bin", "meta/info.json"):
                assert digest(Path(local["ranks"][str(rank)]) / file) == digest(source / file)
        # Node A still answers its own copies; asked on A, node B's is not A's to vouch for.
        assert (await local_of(a, "node-a"))["ranks"] == {  # type: ignore[index]
            str(r): str(p) for r, p in ranks.items()
        }
        assert await local_of(a, "node-b") is None
        # The detail view lists node B's copy, where B's agent answers it.
        detail = (await b.http.get(f"/v1/runs/{RUN}/checkpoints/10")).json()
        t0 = {(c["node"], c["rank"], c["path"]) for c in detail["copies"] if c["tier"] == "t0"}
        assert t0 == {("node-a", r, str(p)) for r, p in ranks.items()} | {
            ("node-b", r, local["ranks"][str(r)]) for r in (0, 1)
        }
        detail = (await a.http.get(f"/v1/runs/{RUN}/checkpoints/10")).json()
        assert {c["node"] for c in detail["copies"] if c["tier"] == "t0"} == {"node-a"}

        # A second prefetch reads nothing: with the region gone it still succeeds.
        shutil.rmtree(region)
        again = await prefetched(a, {"nodes": ["node-b"], "step": 10})
        assert [j["state"] for j in again["jobs"]] == ["succeeded"]
        assert again["jobs"][0]["id"] != out["jobs"][0]["id"]
        assert (await local_of(b, "node-b")) == local
        # A plain restore on node B copies (and hashes) B's copy; without
        # node= it would need the region, which is gone.
        async with AsyncCheckpointClient("http://agent", transport=b.http._transport) as client:
            restored = await client.restore(RUN, tmp_path / "restored", node="node-b")
            for rank, source in ranks.items():
                for file in (f"shard-{rank}.bin", "meta/info.json"):
                    got = restored / f"rank-{rank:05d}" / file
                    assert digest(got) == digest(source / file)
            one = await client.restore(RUN, tmp_path / "rank1", rank=1, node="node-b")
            assert sorted(p.name for p in one.iterdir()) == ["meta", "shard-1.bin"]
            with pytest.raises(RestoreError):
                await client.restore(RUN, tmp_path / "from-region")
            assert not (tmp_path / "from-region").exists()

        # A file changed behind the agent's back: that rank is no longer offered.
        changed = Path(local["ranks"]["1"]) / "shard-1.bin"
        changed.write_bytes(b"x" * changed.stat().st_size)
        assert set((await local_of(b, "node-b"))["ranks"]) == {"0"}  # type: ignore[index]


async def test_a_corrupt_region_is_skipped_for_the_next(catalog_url: str, tmp_path: Path) -> None:
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", tmp_path / "west")]
    async with two_nodes(catalog_url, tmp_path, regions) as (a, b):
        ranks = await save_on(a, 3, world_size=1)
        await a.wait_state(RUN, 3, states=("replicated",))
        # The primary's copy rots (same size, other bytes).
        key = next((tmp_path / "east").rglob("shard-0.bin"))
        key.write_bytes(b"\0" * key.stat().st_size)

        out = await prefetched(b, {"nodes": ["node-b"]})
        assert [j["state"] for j in out["jobs"]] == ["succeeded"]
        local = await local_of(b, "node-b")
        assert local is not None
        got = Path(local["path"]) / "shard-0.bin"
        assert digest(got) == digest(ranks[0] / "shard-0.bin")
        # Nothing half-written is left beside it.
        assert sorted(p.name for p in got.parent.iterdir()) == ["meta", "shard-0.bin"]


async def test_prefetched_copies_count_in_t0_retention(catalog_url: str, tmp_path: Path) -> None:
    regions = [posix_region("east", tmp_path / "east")]
    async with two_nodes(catalog_url, tmp_path, regions, local={"keep_last": 1}) as (a, b):
        await save_on(a, 1, world_size=1)
        await a.wait_state(RUN, 1)
        await prefetched(a, {"nodes": ["node-b"]})
        assert copies.held(b.settings) == {RUN: [1]}
        await save_on(a, 2, world_size=1)
        await a.wait_state(RUN, 2)
        # Through the client this time (the async face; the CLI drives the sync one).
        async with AsyncCheckpointClient("http://agent", transport=a.http._transport) as client:
            done = await client.prefetch(RUN, ["node-b"], wait=True, timeout=60, poll_interval=0.05)
            assert done.step == 2 and done.done and not done.failed
            assert [(j.node, j.state) for j in done.jobs] == [("node-b", "succeeded")]
            listed = await client.prefetch_jobs(RUN)
            assert [(j.step, j.state) for j in listed] == [(2, "succeeded"), (1, "succeeded")]
            assert [j.step for j in await client.prefetch_jobs(RUN, step=1)] == [1]
        assert copies.held(b.settings) == {RUN: [2]}
        assert not copies.step_dir(b.settings, RUN, 1).exists()
        assert (await local_of(b, "node-b")) is not None

        # A node no agent answers for: its job waits, then the retention pass
        # fails it with the reason (a restart does not wait for ever).
        # (More nodes than a page of jobs: the answer still lists each.)
        nodes = ["node-gone", *(f"n{i}" for i in range(150))]
        answer = await a.http.post(f"/v1/runs/{RUN}/prefetch", json={"nodes": nodes})
        assert [j["node"] for j in answer.json()["jobs"]] == nodes
        job = answer.json()["jobs"][0]
        assert job["state"] == "queued"
        assert (await apply_all(a.resources))["prefetch_expired"] == 0
        async with transaction(a.resources.sessionmaker) as session:
            await session.execute(
                update(Job)
                .where(Job.id == job["id"])
                .values(created_at=utcnow() - timedelta(hours=2))
            )
        assert (await apply_all(a.resources))["prefetch_expired"] == 1
        page = await a.http.get(f"/v1/runs/{RUN}/prefetch", params={"step": 2, "limit": 500})
        states = {j["node"]: (j["state"], j["error"]) for j in page.json()["jobs"]}
        assert len(states) == 152  # node-b's, node-gone's, and the 150 others
        assert states["node-gone"][0] == "failed"
        assert "no agent of this node" in states["node-gone"][1]
        assert states["n0"] == ("queued", None)


async def test_bad_prefetch_requests_are_refused_by_name(tmp_path: Path) -> None:
    catalog = f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    async with running_agent(catalog, tmp_path, start_worker=False) as agent:
        url = f"/v1/runs/{RUN}/prefetch"

        async def error(body: Any, status: int, run: str = RUN) -> dict[str, Any]:
            answer = await agent.http.post(f"/v1/runs/{run}/prefetch", json=body)
            assert answer.status_code == status, answer.text
            found: dict[str, Any] = answer.json()["error"]
            return found

        assert (await error({"nodes": ["n"]}, 404))["code"] == "run_not_found"
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": b"w"})
        assert (await agent.register(RUN, 1, ckpt)).status_code == 202
        # No worker: registered, never durable.
        assert (await error({"nodes": ["n"]}, 404))["code"] == "no_valid_checkpoint"
        refused = await error({"nodes": ["n"], "step": 1}, 409)
        assert refused["code"] == "not_valid" and "registered" in refused["message"]
        assert (await error({"nodes": ["n"], "step": 2}, 404))["code"] == "checkpoint_not_found"
        for body in (
            {"nodes": []},
            {"nodes": ["bad/name"]},
            {"nodes": [".."]},
            {"nodes": ["x" * 129]},
            {"nodes": ["n"], "step": -1},
            {"nodes": ["n"], "extra": 1},
            {"node": "n"},
        ):
            assert (await error(body, 422))["code"], body
        message = (await error({"nodes": ["ok", "bad name"]}, 422))["message"]
        assert "bad name" in message
        assert (await error({"nodes": ["n"]}, 422, run="a,b"))["code"] == "invalid_run"
        assert (await agent.http.get(url)).json() == {"run": RUN, "jobs": []}
        assert (await agent.http.get(url, params={"limit": 0})).status_code == 422


async def test_what_a_killed_prefetch_left_is_reused_or_removed(
    catalog_url: str, tmp_path: Path
) -> None:
    region = tmp_path / "east"
    async with two_nodes(catalog_url, tmp_path, [posix_region("east", region)]) as (a, b):
        ranks = await save_on(a, 4, world_size=1)
        await a.wait_state(RUN, 4)
        # As a prefetch killed midway leaves it: one file verified and in
        # place, one half-written temporary file, no marker.
        rank0 = copies.rank_dir(copies.step_dir(b.settings, RUN, 4), 0)
        rank0.mkdir(parents=True)
        shutil.copy(ranks[0] / "shard-0.bin", rank0 / "shard-0.bin")
        (rank0 / ".info.json.tierckpt-tmp-dead").write_bytes(b"{")
        assert await local_of(b, "node-b") is None  # no marker: not offered
        # The file in place is kept, not fetched again: the region loses it.
        next(region.rglob("shard-0.bin")).unlink()
        out = await prefetched(b, {"nodes": ["node-b"]})
        assert [j["state"] for j in out["jobs"]] == ["succeeded"]
        assert sorted(p.name for p in rank0.rglob("*")) == ["info.json", "meta", "shard-0.bin"]
        assert (await local_of(b, "node-b"))["ranks"] == {"0": str(rank0)}  # type: ignore[index]
