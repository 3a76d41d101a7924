"""PostgreSQL: a batch of new checkpoints written in one statement
(checkpoints/fresh_batch.py) leaves exactly the rows the full way writes,
and a batch whose checkpoint exists falls back to the full way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from devsupport import postgres as pg
from devsupport.agent import AT_COMMIT, Agent, posix_region, running_agent, write_checkpoint
from tierckpt.service.checkpoints.schemas import RegisterRequest
from tierckpt.service.checkpoints.service import submit_registration
from tierckpt.service.models import Checkpoint, File, Job, Replica, Run, Shard

pytestmark = pytest.mark.postgres


def _request(run: str, step: int, path: Path, **extra: Any) -> RegisterRequest:
    return RegisterRequest.model_validate({"run": run, "step": step, "path": str(path), **extra})


def _checkpoints(ssd: Path) -> dict[str, Path]:
    return {
        name: write_checkpoint(ssd / name, files)
        for name, files in {
            "lone": {"w.bin": b"w", "meta.json": b"{}"},
            "child": {"w.bin": b"c"},
            **{f"rank{i}": {"w.bin": b"r" * (i + 1), "o.bin": b"o"} for i in range(3)},
            "parent": {"w.bin": b"p"},
            "late": {"w.bin": b"l"},
        }.items()
    }


async def _register_all(agent: Agent, paths: dict[str, Path], one_statement: bool) -> list[Any]:
    """The same registrations, in the same batches, on either way."""
    agent.process.registrations.one_statement = one_statement
    answers: list[Any] = []

    async def batch(requests: list[RegisterRequest]) -> None:
        answers.extend(
            await asyncio.gather(
                *(
                    submit_registration(agent.resources, agent.process.registrations, r)
                    for r in requests
                ),
                return_exceptions=True,
            )
        )

    # The first batch creates the run: the full way for both.
    await batch([_request("r", 1, paths["lone"], metrics={"loss": 0.5}, epoch=3)])
    # A child naming step 9 as its parent before step 9 exists.
    await batch([_request("r", 20, paths["child"], parent={"run": "r", "step": 9})])
    await batch(
        [
            *(
                _request("r", 5, paths[f"rank{i}"], rank=i, world_size=4, metadata={"i": i})
                for i in range(3)
            ),
            # The same content again, urgent: promotes the new checkpoint's jobs.
            _request("r", 5, paths["rank1"], rank=1, world_size=4, priority="urgent"),
            _request("r", 9, paths["parent"], write_seconds=1.5),
        ]
    )
    # The last rank of step 5 later: the checkpoint exists (the full way).
    await batch([_request("r", 5, paths["late"], rank=3, world_size=4)])
    return answers


async def _rows(agent: Agent) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the registrations wrote, ids and times replaced by what they name."""
    async with agent.resources.sessionmaker() as s:
        runs = {r.id: r.name for r in await s.scalars(select(Run))}
        checkpoints = {c.id: c for c in await s.scalars(select(Checkpoint))}
        shards = {x.id: x for x in await s.scalars(select(Shard))}
        files = list(await s.scalars(select(File)))
        jobs = list(await s.scalars(select(Job)))
        replicas = list(await s.scalars(select(Replica)))

    def step_of(checkpoint_id: int) -> tuple[str, int]:
        c = checkpoints[checkpoint_id]
        return runs[c.run_id], c.step

    for job in jobs:
        assert (
            job.dedupe_key == f"{job.kind}:{job.checkpoint_id}:{job.shard_id}:{job.region or '-'}"
        )
        assert job.run_after == job.created_at
    return {
        "checkpoints": sorted(
            (
                runs[c.run_id],
                c.step,
                c.state,
                c.world_size,
                c.epoch,
                c.priority,
                c.metrics,
                c.meta,
                c.parent_run,
                c.parent_step,
                c.write_seconds,
                c.total_bytes,
                c.file_count,
                c.pinned,
                c.error,
                c.durable_at,
            )
            for c in checkpoints.values()
        ),
        "shards": sorted(
            (
                *step_of(x.checkpoint_id),
                x.rank,
                x.node,
                x.path,
                x.is_directory,
                x.state,
                x.fingerprint,
            )
            for x in shards.values()
        ),
        "files": sorted(
            (
                *step_of(shards[f.shard_id].checkpoint_id),
                shards[f.shard_id].rank,
                f.path,
                f.size,
                f.mtime_ns,
                f.expected_sha256,
                f.sha256,
            )
            for f in files
        ),
        "jobs": sorted(
            (
                *step_of(j.checkpoint_id),
                shards[j.shard_id].rank if j.shard_id else None,
                j.kind,
                j.state,
                j.priority,
                j.region,
                j.node,
                str(j.payload),
                j.attempts,
                j.max_attempts,
            )
            for j in jobs
        ),
        "replicas": sorted(
            (*step_of(r.checkpoint_id), r.region, r.state, r.uri, r.error) for r in replicas
        ),
    }


async def test_one_statement_writes_the_rows_the_full_way_writes(
    postgres_admin_url: str, tmp_path: Path
) -> None:
    dumps = []
    answers = []
    misses = []
    ssd = tmp_path / "ssd"  # the same files (paths, mtimes) for both
    paths = _checkpoints(ssd)
    for one_statement in (True, False):
        base = tmp_path / ("one" if one_statement else "full")
        with pg.temp_database(postgres_admin_url) as url:
            async with running_agent(
                url,
                base,
                [
                    posix_region("local", tmp_path / "region"),
                    posix_region("west", tmp_path / "west"),
                ],
                start_worker=False,
                ssd=ssd,
                peers={"copies": 1},
            ) as agent:
                got = await _register_all(agent, paths, one_statement)
                answers.append(
                    [
                        (
                            a.created,
                            [(c.run, c.step) for c in a.record.children] if a.record else None,
                        )
                        if not isinstance(a, BaseException)
                        else repr(a)
                        for a in got
                    ]
                )
                dumps.append(await _rows(agent))
                batcher = agent.process.registrations
                misses.append((batcher.fresh_batches, batcher.fresh_misses))
    assert answers[0] == answers[1]
    # Step 9's record names the child registered before it.
    assert [("r", 20)] in [children for _, children in answers[0]]
    for table in dumps[0]:
        assert dumps[0][table] == dumps[1][table], table
    assert len(dumps[0]["jobs"]) == 2 * 7  # an upload and a peer push per shard
    # Promoted by the urgent registration in the same batch (not the late rank).
    assert {row[5] for row in dumps[0]["jobs"] if row[1] == 5 and row[2] < 3} == {100}
    # Batches 2 and 3 in one statement each (the first makes the run, the
    # last rank's checkpoint was known to exist: no wasted attempt).
    assert misses == [(2, 0), (0, 0)]


async def test_a_checkpoint_another_agent_created_falls_back_to_the_full_way(
    postgres_admin_url: str, tmp_path: Path
) -> None:
    with pg.temp_database(postgres_admin_url) as url:
        async with (
            # Answered at the commit: the group commit's own path, which an
            # inbox record reaches only after its answer.
            running_agent(url, tmp_path / "a", start_worker=False, catalog=AT_COMMIT) as a,
            running_agent(
                url,
                tmp_path / "b",
                start_worker=False,
                server={"node": "node-b"},
                catalog=AT_COMMIT,
            ) as b,
        ):
            await a.register("r", 0, write_checkpoint(a.ssd / "warm", {"w.bin": b"0"}))
            await b.register("r", 1, write_checkpoint(b.ssd / "warm", {"w.bin": b"1"}))
            rank0 = write_checkpoint(a.ssd / "r0", {"w.bin": b"a"})
            rank1 = write_checkpoint(b.ssd / "r1", {"w.bin": b"b"})
            first = await a.register("r", 7, rank0, rank=0, world_size=2)
            assert first.status_code == 202, first.text
            # B never saw step 7: it tries one statement, finds it, goes the full way.
            second = await b.register("r", 7, rank1, rank=1, world_size=2)
            assert second.status_code == 202, second.text
            assert b.process.registrations.fresh_misses == 1
            detail = (await b.http.get("/v1/runs/r/checkpoints/7")).json()
            assert sorted((s["rank"], s["node"]) for s in detail["shards"]) == [
                (0, a.settings.server.node),
                (1, "node-b"),
            ]


async def test_a_parent_in_the_same_batch_goes_the_full_way_in_a_transaction(
    postgres_admin_url: str, tmp_path: Path
) -> None:
    """The statement reads children in its snapshot, which would miss a child
    in the same batch: such a batch is written the full way, in a
    transaction (not statement by statement in autocommit)."""
    with pg.temp_database(postgres_admin_url) as url:
        async with running_agent(url, tmp_path, start_worker=False) as agent:
            await agent.register("r", 0, write_checkpoint(agent.ssd / "warm", {"w.bin": b"0"}))
            batcher = agent.process.registrations
            child = write_checkpoint(agent.ssd / "child", {"w.bin": b"c"})
            parent = write_checkpoint(agent.ssd / "parent", {"w.bin": b"p"})
            answers = await asyncio.gather(
                submit_registration(
                    agent.resources,
                    batcher,
                    _request("r", 31, child, parent={"run": "r", "step": 30}),
                ),
                submit_registration(agent.resources, batcher, _request("r", 30, parent)),
            )
            assert all(a.created for a in answers)
            assert (batcher.fresh_batches, batcher.fresh_misses) == (0, 0)
            record = answers[1].record
            assert record is not None
            assert [(c.run, c.step) for c in record.children] == [("r", 31)]
