"""Lineage across runs, the client's automatic parent after a restore, and
several agents (nodes) sharing one PostgreSQL catalog."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import select

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.client import AsyncCheckpointClient
from tierckpt.service.db import transaction
from tierckpt.service.models import Checkpoint, Job, Run, Shard


async def test_lineage_across_runs_and_auto_parent(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        async with AsyncCheckpointClient("http://agent", transport=agent.http._transport) as client:
            for step, parent in ((1, None), (2, ("base", 1))):
                ckpt = write_checkpoint(agent.ssd / f"base-{step}", {"w": b"%d" % step})
                await client.register("base", step, ckpt, parent=parent)
                await client.wait("base", step, timeout=60)

            # A fine-tune restores base's latest; its next registration
            # records that as the parent without being told.
            await client.restore("base", tmp_path / "restored")
            ft = write_checkpoint(agent.ssd / "ft-10", {"w": b"ft"})
            registered = await client.register("ft", 10, ft)
            assert registered.parent is not None and (
                registered.parent.run,
                registered.parent.step,
            ) == ("base", 2)
            again = write_checkpoint(agent.ssd / "ft-20", {"w": b"ft2"})
            second = await client.register("ft", 20, again, parent=("ft", 10))
            third = await client.register(
                "ft", 30, write_checkpoint(agent.ssd / "ft-30", {"w": b"3"})
            )
            assert third.parent is None  # remembered once, then forgotten
            assert second.parent is not None
            for step in (10, 20, 30):
                await client.wait("ft", step, timeout=60)

            lineage = await client.lineage("ft", 20)
            assert [(n.run, n.step) for n in lineage.ancestors] == [
                ("ft", 10),
                ("base", 2),
                ("base", 1),
            ]
            assert all(n.state == "durable" for n in lineage.ancestors)
            base = await client.lineage("base", 2)
            assert [(n.run, n.step) for n in base.children] == [("ft", 10)]

        missing = await agent.http.get("/v1/runs/ft/checkpoints/99/lineage")
        assert missing.status_code == 404


@pytest.mark.postgres
async def test_two_agents_share_one_postgres_catalog(postgres_url: str, tmp_path: Path) -> None:
    catalog = postgres_url
    region = [{"name": "shared", "kind": "posix", "root": str(tmp_path / "region")}]
    async with (
        running_agent(
            catalog, tmp_path / "a", region, ssd=tmp_path / "ssd-a", server={"node": "node-a"}
        ) as a,
        running_agent(
            catalog, tmp_path / "b", region, ssd=tmp_path / "ssd-b", server={"node": "node-b"}
        ) as b,
    ):
        # One sharded checkpoint: rank 0 on node a, rank 1 on node b.
        r0 = write_checkpoint(a.ssd / "s1-r0", {"shard.bin": 3 << 20})
        r1 = write_checkpoint(b.ssd / "s1-r1", {"shard.bin": 2 << 20})
        answers = await asyncio.gather(
            a.register("dist", 1, r0, rank=0, world_size=2),
            b.register("dist", 1, r1, rank=1, world_size=2),
        )
        assert sorted(x.status_code for x in answers) == [202, 202]
        done = await a.wait_state("dist", 1)
        assert {(s["rank"], s["node"]) for s in done["shards"]} == {(0, "node-a"), (1, "node-b")}
        assert {(f["rank"], f["path"]) for f in done["files"]} == {
            (0, "shard.bin"),
            (1, "shard.bin"),
        }

        # Each agent reads only its own SSD.
        refused = await a.register("dist", 2, r1)
        assert (
            refused.status_code == 400 and refused.json()["error"]["code"] == "path_outside_roots"
        )

        # Many registrations through both agents: each upload runs once, on
        # the node that holds the files.
        async def burst(agent, name: str) -> None:  # type: ignore[no-untyped-def]
            for step in range(10, 20):
                ckpt = write_checkpoint(agent.ssd / f"{name}-{step}", {"w": step * 1000})
                assert (await agent.register(f"run-{name}", step, ckpt)).status_code == 202

        await asyncio.gather(burst(a, "a"), burst(b, "b"))
        for name, agent in (("a", a), ("b", b)):
            for step in range(10, 20):
                await agent.wait_state(f"run-{name}", step)

        async with transaction(a.resources.sessionmaker) as session:
            rows = (
                await session.execute(
                    select(Job.attempts, Job.lease_owner, Shard.node)
                    .join(Shard, Shard.id == Job.shard_id)
                    .join(Checkpoint, Checkpoint.id == Shard.checkpoint_id)
                    .join(Run, Run.id == Checkpoint.run_id)
                    # The session's database holds other tests' jobs too.
                    .where(Job.kind == "upload", Run.name.in_(["dist", "run-a", "run-b"]))
                )
            ).all()
        assert len(rows) == 22  # 2 ranks + 2 x 10
        for attempts, owner, node in rows:
            assert attempts == 1 and owner.startswith(f"{node}:")
