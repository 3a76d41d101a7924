"""Retention across tiers on a real SeaweedFS region: objects go, the latest
valid and pinned checkpoints stay; quarantine, explicit delete, T0 eviction
and the expiry of checkpoints whose ranks never all arrived."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from devsupport import statements
from devsupport.agent import Agent, running_agent, s3_region, write_checkpoint
from devsupport.catalog_lock import rows
from devsupport.seaweed import SeaweedServer
from tierckpt.service.db import reading, transaction
from tierckpt.service.jobs import kinds, queue
from tierckpt.service.models import (
    Checkpoint,
    CheckpointState,
    Job,
    JobKind,
    JobState,
    Run,
    utcnow,
)
from tierckpt.service.retention import at_durable
from tierckpt.service.retention.service import (
    DELETIONS_PER_TRANSACTION,
    apply_all,
    evict_local_copies,
    queue_deletions,
)


def keys_of_step(s3_client: Any, bucket: str, step: int) -> set[str]:
    prefix = f"prod/r/step-{step:012d}/"
    answer = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for o in answer.get("Contents", [])}


async def wait_deleted(agent: Agent, step: int) -> dict[str, Any]:
    for _ in range(600):
        detail = (await agent.http.get(f"/v1/runs/r/checkpoints/{step}")).json()
        if detail["state"] == "deleted" and detail["deleted_at"]:
            return detail
        await asyncio.sleep(0.05)
    raise AssertionError(f"step {step} not deleted: {detail}")


async def wait_until(condition: Callable[[], bool], what: str = "") -> None:
    for _ in range(600):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached in 30 s: {what}")


_RETAIN_PENDING = (
    "SELECT count(*) FROM jobs WHERE kind = 'retain' AND state IN ('queued', 'running')"
)


async def test_retention_deletes_objects_but_keeps_latest_and_pinned(
    catalog_url: str, tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, s3_client: Any
) -> None:
    regions = [s3_region("east", seaweed.endpoint_url, s3_bucket)]
    async with running_agent(catalog_url, tmp_path, regions, local={"keep_last": 1}) as agent:
        for step in range(1, 7):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": 1000 + step, "m/x": b"x"})
            answer = await agent.register(
                "r", step, ckpt, metrics={"loss": 10 - step if step != 2 else 0.1}
            )
            assert answer.status_code == 202
            await agent.wait_state("r", step)
        assert all(keys_of_step(s3_client, s3_bucket, s) for s in range(1, 7))
        # Each durable checkpoint queued a retain job (retention at durable):
        # one still to run after the policy below would queue the deletions
        # before the explicit apply does.
        await wait_until(
            lambda: rows(catalog_url, _RETAIN_PENDING) == [(0,)], "the retain jobs have run"
        )

        # Step 4 pinned; step 6 quarantined, so the latest valid is 5.
        assert (await agent.http.post("/v1/runs/r/checkpoints/4/pin")).json()["pinned"] is True
        quarantined = await agent.http.post(
            "/v1/runs/r/checkpoints/6/quarantine", json={"reason": "loss diverged after it"}
        )
        assert quarantined.json()["quarantine_reason"] == "loss diverged after it"
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 5

        policy = {"keep_last": 1, "keep_best": {"metric": "loss", "mode": "min", "n": 1}}
        put = await agent.http.put("/v1/runs/r/retention", json=policy)
        assert put.status_code == 200 and put.json()["overridden"] is True
        # keep_last=1 keeps 6 (quarantined, still the newest); keep_best keeps
        # 2; 5 is the latest valid; 4 is pinned: 1 and 3 go.
        assert put.json()["would_delete"] == [1, 3]
        applied = (await agent.http.post("/v1/runs/r/retention/apply")).json()
        assert applied["delete_queued"] == [1, 3]
        for step in (1, 3):
            detail = await wait_deleted(agent, step)
            assert detail["deleted_reason"].startswith("retention (keep_last=1")
            assert [r["state"] for r in detail["replicas"]] == ["deleted"]
            assert keys_of_step(s3_client, s3_bucket, step) == set()
        for step in (2, 4, 5, 6):
            assert len(keys_of_step(s3_client, s3_bucket, step)) == 3  # 2 files + manifest

        # Explicit delete: pinned refused, latest refused without force.
        assert (await agent.http.delete("/v1/runs/r/checkpoints/4")).status_code == 409
        latest_delete = await agent.http.delete("/v1/runs/r/checkpoints/5")
        assert (
            latest_delete.status_code == 409
            and latest_delete.json()["error"]["code"] == "latest_valid"
        )
        assert (await agent.http.delete("/v1/runs/r/checkpoints/2")).status_code == 202
        await wait_deleted(agent, 2)
        assert keys_of_step(s3_client, s3_bucket, 2) == set()

        # Lifting the quarantine makes 6 the answer again.
        await agent.http.delete("/v1/runs/r/checkpoints/6/quarantine")
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 6

        pinned = (await agent.http.get("/v1/runs/r/checkpoints", params={"pinned": "true"})).json()
        assert [c["step"] for c in pinned["checkpoints"]] == [4]
        deleted = (
            await agent.http.get("/v1/runs/r/checkpoints", params={"state": "deleted"})
        ).json()
        assert sorted(c["step"] for c in deleted["checkpoints"]) == [1, 2, 3]


async def test_t0_copies_are_evicted_only_when_durable_and_beyond_keep_last(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(
        catalog_url, tmp_path, local={"keep_last": 2}, start_worker=False
    ) as agent:
        dirs = {}
        for step in range(1, 5):
            dirs[step] = write_checkpoint(
                agent.ssd / "run" / f"s{step}", {"a/w.bin": 10, "b": b"1"}
            )
            assert (await agent.register("r", step, dirs[step])).status_code == 202
        # Nothing is durable yet: nothing may be evicted.
        assert await evict_local_copies(agent.resources) == 0
    async with running_agent(catalog_url, tmp_path, local={"keep_last": 2}) as agent:
        for step in range(1, 5):
            await agent.wait_state("r", step)
        # Evicted as the checkpoints became durable (retain jobs), not by a sweep.
        await wait_until(lambda: not dirs[1].exists() and not dirs[2].exists())
        assert (dirs[3] / "a" / "w.bin").exists() and (dirs[4] / "b").exists()
        assert (agent.ssd / "run").is_dir()  # never above the shard's own directory
        detail = (await agent.http.get("/v1/runs/r/latest", params={"node": "node-test"})).json()
        assert detail["step"] == 4 and detail["local"]["path"] == str(dirs[4].resolve())


async def test_evictions_side_by_side_remove_and_mark_each_copy_once(
    catalog_url: str, tmp_path: Path
) -> None:
    """A retain job and the periodic sweep evicting at once (two callers here)
    take turns: each T0 copy is removed and marked evicted by one of them, in
    one write, not by both."""
    async with running_agent(catalog_url, tmp_path, local={"keep_last": 10}) as agent:
        for step in range(1, 5):
            directory = write_checkpoint(agent.ssd / "run" / f"s{step}", {"w.bin": 10})
            assert (await agent.register("r", step, directory)).status_code == 202
        for step in range(1, 5):
            await agent.wait_state("r", step)
    async with running_agent(
        catalog_url, tmp_path, local={"keep_last": 1}, start_worker=False
    ) as agent:
        evicted_marks = statements.starting("UPDATE shards SET evicted_at")
        with statements.recorded(agent.resources.engine, evicted_marks) as marks:
            evicted = await asyncio.gather(
                evict_local_copies(agent.resources), evict_local_copies(agent.resources)
            )
        assert sorted(evicted) == [0, 3]
        assert len(marks) == 3
        assert not (agent.ssd / "run" / "s3").exists()
        assert (agent.ssd / "run" / "s4" / "w.bin").exists()


async def test_missing_ranks_expire_and_never_shadow_an_older_checkpoint(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path) as agent:
        whole = write_checkpoint(agent.ssd / "s1", {"w": b"1"})
        assert (await agent.register("r", 1, whole)).status_code == 202
        await agent.wait_state("r", 1)
        half = write_checkpoint(agent.ssd / "s2", {"w": b"2"})
        assert (await agent.register("r", 2, half, rank=0, world_size=4)).status_code == 202
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 1

        async with transaction(agent.resources.sessionmaker) as session:
            await session.execute(
                update(Checkpoint)
                .where(Checkpoint.step == 2)
                .values(created_at=utcnow() - timedelta(days=2))
            )
        outcome = await apply_all(agent.resources)
        assert outcome["expired"] == 1
        detail = (await agent.http.get("/v1/runs/r/checkpoints/2")).json()
        assert detail["state"] == "failed" and "only 1 of 4 ranks" in detail["error"]
        assert (await agent.http.get("/v1/runs/r/latest")).json()["step"] == 1


async def test_eviction_of_a_single_file_checkpoint_keeps_the_trainers_directory(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, local={"keep_last": 0}) as agent:
        out = agent.ssd / "trainer-out"
        (out / "logs").mkdir(parents=True)
        model = write_checkpoint(out, {"model-1.pt": b"w"}) / "model-1.pt"
        assert (await agent.register("r", 1, model)).status_code == 202
        await agent.wait_state("r", 1)
        await wait_until(lambda: not model.exists())
        assert out.is_dir() and (out / "logs").is_dir()  # not the checkpoint's to remove


async def test_retention_applies_when_a_checkpoint_becomes_durable(
    catalog_url: str,
    tmp_path: Path,
    seaweed: SeaweedServer,
    seaweed_west: SeaweedServer,
    s3_bucket: str,
    s3_client: Any,
) -> None:
    """keep_last = 2 with the periodic sweep an hour away: within seconds of
    each checkpoint becoming durable, the run holds 2 durable checkpoints (plus
    the protected ones: 3, pinned) in every region, and T0 its newest 2."""
    west_bucket = seaweed_west.create_bucket(f"west-{s3_bucket}")
    west = seaweed_west.client()
    regions = [
        s3_region("east", seaweed.endpoint_url, s3_bucket),
        s3_region("west", seaweed_west.endpoint_url, west_bucket),
    ]
    async with running_agent(
        catalog_url,
        tmp_path,
        regions,
        local={"keep_last": 2},
        retention={"keep_last": 2, "interval_seconds": 3600},
    ) as agent:
        dirs = {}
        for step in range(1, 6):
            dirs[step] = write_checkpoint(agent.ssd / "run" / f"s{step}", {"w.bin": 1000 + step})
            assert (await agent.register("r", step, dirs[step])).status_code == 202
            await agent.wait_state("r", step, ("replicated",))
            if step == 3:
                # Pinned: protected, so it stays beside the newest two.
                assert (await agent.http.post("/v1/runs/r/checkpoints/3/pin")).status_code == 200
        for step in (1, 2):
            detail = await wait_deleted(agent, step)
            assert detail["deleted_reason"].startswith("retention (keep_last=2")
            assert {r["state"] for r in detail["replicas"]} == {"deleted"}
            assert keys_of_step(s3_client, s3_bucket, step) == set()
            assert keys_of_step(west, west_bucket, step) == set()
        await wait_until(
            lambda: not any(dirs[s].exists() for s in (1, 2, 3)), "T0 beyond keep_last evicted"
        )
        for step in (3, 4, 5):
            assert keys_of_step(s3_client, s3_bucket, step) and keys_of_step(
                west, west_bucket, step
            )
        assert dirs[4].exists() and dirs[5].exists()
        states = {
            c["step"]: c["state"]
            for c in (await agent.http.get("/v1/runs/r/checkpoints")).json()["checkpoints"]
        }
        assert states == {
            1: "deleted",
            2: "deleted",
            3: "replicated",
            4: "replicated",
            5: "replicated",
        }


async def test_one_retain_job_covers_those_of_its_run_queued_before_it(
    catalog_url: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """Checkpoints turning durable faster than the worker gets to their retain
    jobs (a backlog of uploads): the first to run plans the run once and
    marks the other retain jobs of its run and node, queued before it read
    the catalog, done. One queued while it runs (a checkpoint turning durable
    meanwhile) and another run's stay queued."""
    async with running_agent(
        catalog_url,
        tmp_path,
        start_worker=False,  # the jobs stay queued until the test runs them
        retention={"keep_last": 1, "interval_seconds": 3600},
    ) as agent:
        for run, step in [("r", 1), ("r", 2), ("r", 3), ("r", 4), ("other", 1)]:
            ckpt = write_checkpoint(agent.ssd / run / f"s{step}", {"w.bin": 100 + step})
            assert (await agent.register(run, step, ckpt)).status_code == 202
            await agent.in_catalog(run)
        sessionmaker = agent.resources.sessionmaker
        async with transaction(sessionmaker) as session:
            checkpoints = {
                (run, c.step): c
                for c, run in (
                    await session.execute(
                        select(Checkpoint, Run.name).join(Run, Run.id == Checkpoint.run_id)
                    )
                ).all()
            }
            for checkpoint in checkpoints.values():
                checkpoint.state = CheckpointState.DURABLE
                checkpoint.durable_at = utcnow()
            for key in [("r", 1), ("r", 2), ("r", 3), ("other", 1)]:
                await kinds.enqueue_retention(session, checkpoints[key])
        ids = {key: c.id for key, c in checkpoints.items()}

        async def retain_state() -> dict[tuple[str, int], str]:
            async with reading(sessionmaker)() as session:
                found = await session.execute(
                    select(Job.checkpoint_id, Job.state).where(Job.kind == JobKind.RETAIN)
                )
                by_id = {checkpoint_id: key for key, checkpoint_id in ids.items()}
                return {by_id[checkpoint_id]: state for checkpoint_id, state in found}

        real_queue_deletions = at_durable.queue_deletions

        async def durable_meanwhile(resources: Any, run_id: int | None = None) -> int:
            # Step 4 turns durable while the pass plans: its retain job is queued
            # after the pass's first read, so the pass does not cover it.
            async with transaction(sessionmaker) as session:
                await kinds.enqueue_retention(session, checkpoints[("r", 4)])
            return await real_queue_deletions(resources, run_id)

        monkeypatch.setattr(at_durable, "queue_deletions", durable_meanwhile)
        async with transaction(sessionmaker) as session:
            first = await session.scalar(
                select(Job.id).where(Job.kind == JobKind.RETAIN, Job.checkpoint_id == ids[("r", 1)])
            )
            assert first is not None
            job = await queue.claim_queued(session, first, owner="test", lease_seconds=60)
        assert job is not None
        await at_durable.RetainJobs(agent.resources).retain(job)

        assert await retain_state() == {
            ("r", 1): JobState.SUCCEEDED,  # run
            ("r", 2): JobState.SUCCEEDED,  # covered
            ("r", 3): JobState.SUCCEEDED,  # covered
            ("r", 4): JobState.QUEUED,  # queued after the pass's first read
            ("other", 1): JobState.QUEUED,  # another run
        }
        async with reading(sessionmaker)() as session:
            deleting = set(
                await session.scalars(select(Job.checkpoint_id).where(Job.kind == JobKind.DELETE))
            )
        # The pass did the covered jobs' work: keep_last = 1 of r's durable ones.
        assert {ids[("r", s)] for s in (1, 2, 3)} <= deleting
        assert ids[("other", 1)] not in deleting


async def test_a_pass_queues_only_new_deletions_a_few_per_statement(
    catalog_url: str, tmp_path: Path
) -> None:
    """A run that registers faster than its deletions finish: each pass
    queues what is new only, in short transactions of one statement each
    (every write transaction holds the SQLite write lock a registration
    waits for); checkpoints whose deletion is queued are left out when
    planning, on the read snapshot."""
    async with running_agent(
        catalog_url,
        tmp_path,
        start_worker=False,  # the delete jobs stay queued
        retention={"keep_last": 1, "interval_seconds": 3600},
    ) as agent:
        for step in range(1, 41):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": 100 + step})
            assert (await agent.register("r", step, ckpt)).status_code == 202
        async with transaction(agent.resources.sessionmaker) as session:
            await session.execute(update(Checkpoint).values(state=CheckpointState.DURABLE))

        job_inserts = statements.starting("INSERT INTO jobs")
        with statements.recorded(agent.resources.engine, job_inserts) as inserts:
            assert await queue_deletions(agent.resources) == 39
            assert len(inserts) == -(-39 // DELETIONS_PER_TRANSACTION)
            inserts.clear()
            assert await queue_deletions(agent.resources) == 0
            assert inserts == []  # all 39 were queued already: nothing written

            # A newer checkpoint: the next pass queues its predecessor only.
            ckpt = write_checkpoint(agent.ssd / "s41", {"w.bin": 141})
            assert (await agent.register("r", 41, ckpt)).status_code == 202
            async with transaction(agent.resources.sessionmaker) as session:
                await session.execute(update(Checkpoint).values(state=CheckpointState.DURABLE))
            assert await queue_deletions(agent.resources) == 1
            assert len(inserts) == 1
        async with reading(agent.resources.sessionmaker)() as session:
            deletes = list(
                await session.scalars(select(Job.checkpoint_id).where(Job.kind == JobKind.DELETE))
            )
            rows = (await session.execute(select(Checkpoint.id, Checkpoint.step))).all()
        steps = {checkpoint_id: step for checkpoint_id, step in rows}
        assert sorted(steps[i] for i in deletes) == list(range(1, 41))
