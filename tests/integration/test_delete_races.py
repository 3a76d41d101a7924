"""A checkpoint deleted while its upload, commit or replication is still running.

Deletion marks the checkpoint deleted, then removes its objects region by
region. An upload, a commit or a replication already under way can land objects after that
sweep went by: they must be taken back, never left as a commit marker (which
a catalog rebuild reads) or as objects nobody owns, and the catalog must stay
"deleted" with no replica claiming to be committed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from devsupport.agent import Agent, posix_region, running_agent, write_checkpoint
from tierckpt.service.models import Checkpoint, Job, PeerCopy, Replica, Shard
from tierckpt.service.peers import receive
from tierckpt.service.storage.base import StoreError


async def _jobs_done(agent: Agent, kind: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with agent.resources.sessionmaker() as session:
            states = list(await session.scalars(select(Job.state).where(Job.kind == kind)))
        if states and all(s in ("succeeded", "failed") for s in states):
            assert set(states) == {"succeeded"}, states
            return
        assert time.monotonic() < deadline, f"{kind} jobs: {states}"
        await asyncio.sleep(0.05)


def _left_in_region(tmp_path: Path, name: str = "local") -> list[str]:
    """The objects in a region of running_agent (a directory under tmp_path)."""
    region = tmp_path / f"region-{name}"
    return sorted(str(p.relative_to(region)) for p in region.rglob("*") if p.is_file())


async def _delete_and_sweep(agent: Agent, *, force: bool = False) -> None:
    """Delete r:1 and wait for its delete job: the catalog, then every
    region's sweep."""
    query = "?force=true" if force else ""
    deleted = await agent.http.delete(f"/v1/runs/r/checkpoints/1{query}")
    assert deleted.status_code == 202, deleted.text
    await _jobs_done(agent, "delete")


@pytest.mark.parametrize("moment", ["upload", "commit"])
async def test_deleted_mid_flight_leaves_nothing_in_the_region(
    catalog_url: str, tmp_path: Path, moment: str
) -> None:
    async with running_agent(catalog_url, tmp_path, worker={"poll_interval": 0.05}) as agent:
        store: Any = agent.resources.stores["local"]
        put_bytes = store.put_bytes

        raced = False

        async def put_then_race(key: str, data: Any) -> None:
            # The worst moment: the whole deletion (catalog, then this
            # region's sweep) runs between this write's start and its landing.
            nonlocal raced
            if not raced and (moment == "commit") == key.endswith("MANIFEST.json"):
                raced = True
                await _delete_and_sweep(agent)
            await put_bytes(key, data)

        store.put_bytes = put_then_race
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": 1000, "b/c.json": b"{}"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await _jobs_done(agent, "upload")
        if moment == "commit":
            await _jobs_done(agent, "commit")
        assert raced

        assert _left_in_region(tmp_path) == []
        async with agent.resources.sessionmaker() as session:
            assert await session.scalar(select(Checkpoint.state)) == "deleted"
            replicas = list(await session.scalars(select(Replica.state)))
        assert "committed" not in replicas, replicas
        assert (await agent.http.get("/v1/runs/r/latest")).status_code == 404


@pytest.mark.parametrize("moment", ["upload", "commit"])
async def test_a_job_run_again_after_a_deletion_takes_back_what_it_wrote(
    catalog_url: str, tmp_path: Path, moment: str
) -> None:
    """An upload or a commit whose object landed after the deletion's sweep,
    and which then ended before taking it back (here its connection drops
    right after the write; a kill -9 leaves the same): its next run finds the
    checkpoint deleted and takes the object back before the job is done."""
    async with running_agent(catalog_url, tmp_path, worker={"poll_interval": 0.05}) as agent:
        store: Any = agent.resources.stores["local"]
        put_bytes = store.put_bytes
        dropped = False

        async def deleted_then_land_then_drop(key: str, data: Any) -> None:
            nonlocal dropped
            if dropped or (moment == "commit") != key.endswith("MANIFEST.json"):
                await put_bytes(key, data)
                return
            dropped = True
            await _delete_and_sweep(agent)
            await put_bytes(key, data)
            raise StoreError("the connection dropped after the write landed")

        store.put_bytes = deleted_then_land_then_drop
        ckpt = write_checkpoint(agent.ssd / "s1", {"b/c.json": b"{}"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await _jobs_done(agent, moment)
        assert dropped

        assert _left_in_region(tmp_path) == []
        async with agent.resources.sessionmaker() as session:
            assert await session.scalar(select(Checkpoint.state)) == "deleted"


@pytest.mark.parametrize("then", ["goes on", "drops"])
async def test_deleted_while_replicating_leaves_nothing_in_the_target_region(
    catalog_url: str, tmp_path: Path, then: str
) -> None:
    """The replication job's manifest lands after the deletion swept the
    target region: it is taken back, and the replica is not committed. Also
    when the job's connection drops right after that write (as a kill -9
    would leave it): its next run takes the objects back."""
    regions = [posix_region(name, tmp_path / f"region-{name}") for name in ("local", "west")]
    async with running_agent(
        catalog_url,
        tmp_path,
        regions,
        upload={"fan_out": False},
        worker={"poll_interval": 0.05},
    ) as agent:
        store: Any = agent.resources.stores["west"]
        put_bytes = store.put_bytes
        raced = False

        async def put_then_race(key: str, data: Any) -> None:
            nonlocal raced
            if not raced and key.endswith("MANIFEST.json"):
                raced = True
                # Durable in the primary, so the latest valid: force.
                await _delete_and_sweep(agent, force=True)
                await put_bytes(key, data)
                if then == "drops":
                    raise StoreError("the connection dropped after the write landed")
                return
            await put_bytes(key, data)

        store.put_bytes = put_then_race
        ckpt = write_checkpoint(agent.ssd / "s1", {"a.bin": 1000, "b/c.json": b"{}"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await _jobs_done(agent, "replicate")
        assert raced

        assert _left_in_region(tmp_path, "west") == []
        async with agent.resources.sessionmaker() as session:
            assert await session.scalar(select(Checkpoint.state)) == "deleted"
            replicas = list(await session.scalars(select(Replica.state)))
        assert "committed" not in replicas, replicas


@pytest.mark.parametrize("moment", ["before the commit", "during the commit"])
async def test_a_peer_copy_of_a_deleted_checkpoint_is_refused_and_discarded(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """Node A's checkpoint is being pushed to node B when it is deleted: B
    refuses the rest of the push, 409 ``checkpoint_gone``, and keeps none of
    it: no partial directory, no copy, no committed copy in the catalog.
    "during the commit": the deletion lands after the commit read the
    checkpoint's state (here: it is handed the state read before the
    deletion) and before it records the copy, which it has renamed into
    place by then."""
    region = [posix_region("local", tmp_path / "region-local")]
    async with running_agent(
        catalog_url, tmp_path, region, ssd=tmp_path / "ssd-a", server={"node": "node-a"}
    ) as a:
        ckpt = write_checkpoint(a.ssd / "s1", {"a.bin": 3000, "b.bin": 2000})
        assert (await a.register("r", 1, ckpt)).status_code == 202
        await _jobs_done(a, "upload")  # the catalog has the files' hashes
        async with a.resources.sessionmaker() as session:
            shard_id = await session.scalar(select(Shard.id))
    async with running_agent(
        catalog_url, tmp_path, region, ssd=tmp_path / "ssd-b", server={"node": "node-b"}
    ) as b:
        files = f"/v1/peers/shards/{shard_id}/files"
        for name in ["a.bin"] if moment == "before the commit" else ["a.bin", "b.bin"]:
            sent = await b.http.put(f"{files}/{name}", content=(ckpt / name).read_bytes())
            assert sent.status_code == 200, sent.text
        assert list(b.ssd.rglob("a.bin*")), "a file was not kept while the checkpoint lived"
        before = await receive.load_shard(b.resources, shard_id)

        await _delete_and_sweep(b, force=True)

        refusals = []
        if moment == "before the commit":
            refusals.append(
                await b.http.put(f"{files}/b.bin", content=(ckpt / "b.bin").read_bytes())
            )
        else:

            async def stale(resources: Any, shard: int) -> receive.ShardInfo:
                return before

            monkeypatch.setattr(receive, "load_shard", stale)
        refusals.append(await b.http.post(f"/v1/peers/shards/{shard_id}/commit"))
        for refused in refusals:
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "checkpoint_gone"
            assert "deleted" in refused.json()["error"]["message"]
        assert [p for p in b.ssd.rglob("*") if p.is_file()] == []
        async with b.resources.sessionmaker() as session:
            copies = list(await session.scalars(select(PeerCopy.state)))
        assert "committed" not in copies, copies
