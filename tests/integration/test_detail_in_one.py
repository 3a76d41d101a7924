"""PostgreSQL's one-statement detail read (checkpoints/detail_in_one.py)
answers what the ORM session's seven statements do (repository.detail_rows),
for a checkpoint with every kind of row the detail lists: shards (one
evicted from T0), files, replicas (committed and verified, pending with an
error), jobs (one without a shard), peer copies and a child; and the agent's
detail view on PostgreSQL is made from it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from devsupport.agent import posix_region, running_agent
from tierckpt.service.checkpoints import detail_in_one
from tierckpt.service.checkpoints import repository as repo
from tierckpt.service.checkpoints.presenter import checkpoint_document, detail_listing
from tierckpt.service.memory.lookup import _t0_copies
from tierckpt.service.models import (
    Checkpoint,
    File,
    Job,
    PeerCopy,
    Replica,
    Run,
    Shard,
    utcnow,
)
from tierckpt.service.peers.view import peer_view

pytestmark = pytest.mark.postgres
RUN = "detailed"
STEP = 300


async def _seed(agent: Any) -> None:
    now = utcnow().replace(microsecond=123456)
    async with agent.resources.sessionmaker() as session:
        run, other = Run(name=RUN), Run(name="child-run")
        session.add_all([run, other])
        await session.flush()
        checkpoint = Checkpoint(
            run_id=run.id,
            step=STEP,
            state="durable",
            world_size=2,
            epoch=3,
            priority="urgent",
            parent_run=RUN,
            parent_step=200,
            created_at=now - timedelta(seconds=30),
            durable_at=now - timedelta(seconds=10),
            file_count=3,
            total_bytes=33,
            metrics={"loss": 0.25, "tokens": 1e12},
            meta={"note": "é ünïcode", "nested": {"lr": [1, 2.5]}},
            write_seconds=1.5,
            pinned=True,
        )
        session.add(checkpoint)
        await session.flush()
        shards = []
        for rank in (1, 0):  # inserted out of rank order
            shard = Shard(
                checkpoint_id=checkpoint.id,
                rank=rank,
                node=f"node-{rank}",
                path=f"/ssd/{RUN}/{STEP}/rank-{rank}",
                state="uploaded",
                fingerprint=f"{rank:064d}",
                error="slow disk" if rank else None,
                evicted_at=now if rank == 1 else None,
            )
            session.add(shard)
            await session.flush()
            shards.append(shard)
            names = ("z.pt", "a.pt") if rank == 0 else ("m.pt",)
            await session.execute(
                insert(File),
                [
                    {
                        "shard_id": shard.id,
                        "path": name,
                        "size": 10 + rank,
                        "mtime_ns": 1,
                        "sha256": None if name == "m.pt" else f"{rank:064d}",
                    }
                    for name in names
                ],
            )
        session.add_all(
            [
                Replica(
                    checkpoint_id=checkpoint.id,
                    region="west",
                    state="pending",
                    uri=f"/west/{RUN}/{STEP}/",
                    error="store unreachable",
                ),
                Replica(
                    checkpoint_id=checkpoint.id,
                    region="east",
                    state="committed",
                    uri=f"/east/{RUN}/{STEP}/",
                    committed_at=now - timedelta(seconds=9),
                    verified_at=now - timedelta(seconds=1),
                ),
            ]
        )
        for n, (kind, state, shard, region) in enumerate(
            [
                ("upload", "succeeded", shards[1], "east"),
                ("upload", "failed", shards[0], "west"),
                ("commit", "queued", None, "east"),
            ]
        ):
            session.add(
                Job(
                    kind=kind,
                    state=state,
                    checkpoint_id=checkpoint.id,
                    shard_id=None if shard is None else shard.id,
                    region=region,
                    attempts=n,
                    last_error="timed out" if state == "failed" else None,
                    dedupe_key=f"{kind}:{n}",
                )
            )
        for node, shard, state in (
            ("node-7", shards[0], "committed"),
            ("node-3", shards[1], "committed"),
            ("node-3", shards[0], "pending"),
        ):
            session.add(
                PeerCopy(
                    shard_id=shard.id,
                    checkpoint_id=checkpoint.id,
                    node=node,
                    path=f"/peers/{node}/{shard.rank}",
                    state=state,
                    committed_at=now if state == "committed" else None,
                    verified_at=now - timedelta(seconds=2) if node == "node-7" else None,
                )
            )
        session.add(Checkpoint(run_id=other.id, step=5, parent_run=RUN, parent_step=STEP))
        session.add(Checkpoint(run_id=run.id, step=400, parent_run=RUN, parent_step=STEP))
        await session.commit()


def _answer(rows: repo.DetailRows) -> dict[str, Any]:
    """What the detail view makes of the rows: the document (without the
    pending replica's lag, which grows with the clock), the T0 and peer
    copies."""
    listing = detail_listing(rows, ["east", "west"])
    document = checkpoint_document(RUN, rows.checkpoint, listing)
    for replica in document["replicas"]:
        if replica["state"] == "pending":
            replica["lag_seconds"] = "grows"
    peers = peer_view(rows.checkpoint, rows.shards, rows.peer_copies, 2)
    return {
        "document": document,
        "id": rows.checkpoint.id,
        "t0": _t0_copies(rows.shards),
        "peers": (peers.peers, peers.peer_safe, peers.copies),
    }


async def test_one_statement_answers_what_the_session_reads(
    postgres_url: str, tmp_path: Path
) -> None:
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", tmp_path / "west")]
    async with running_agent(postgres_url, tmp_path, regions, start_worker=False) as agent:
        await _seed(agent)
        async with agent.resources.sessionmaker() as session:
            by_session = await session.run_sync(repo.detail_rows, RUN, STEP)
        in_one = await agent.resources.rows.read(detail_in_one.detail_rows, RUN, STEP)
        assert by_session is not None and in_one is not None
        expected, got = _answer(by_session), _answer(in_one)
        assert got == expected
        # The rows the seed made distinct are all there.
        assert [s["rank"] for s in got["document"]["shards"]] == [0, 1]
        assert [(f["rank"], f["path"]) for f in got["document"]["files"]] == [
            (0, "a.pt"),
            (0, "z.pt"),
            (1, "m.pt"),
        ]
        assert [j["rank"] for j in got["document"]["jobs"]] == [0, 1, None]
        assert got["document"]["children"] == [
            {"run": "child-run", "step": 5},
            {"run": RUN, "step": 400},
        ]
        assert got["t0"] == [
            {
                "tier": "t0",
                "node": "node-0",
                "rank": 0,
                "path": f"/ssd/{RUN}/{STEP}/rank-0",
                "region": None,
                "uri": None,
            }
        ]
        assert got["document"]["replicas"][0]["verified_at"].endswith(".123Z")

        # A checkpoint with none of those rows: every list empty.
        async with agent.resources.sessionmaker() as session:
            bare = await session.run_sync(repo.detail_rows, RUN, 400)
        bare_in_one = await agent.resources.rows.read(detail_in_one.detail_rows, RUN, 400)
        assert bare is not None and bare_in_one is not None
        assert _answer(bare_in_one) == _answer(bare)
        assert bare_in_one.shards == [] and bare_in_one.peer_copies == []

        assert await agent.resources.rows.read(detail_in_one.detail_rows, RUN, 999) is None

        # The agent's detail view (PostgreSQL: made from the one statement).
        answer = await agent.http.get(f"/v1/runs/{RUN}/checkpoints/{STEP}")
        assert answer.status_code == 200, answer.text
        view = answer.json()
        for key in ("state", "shards", "files", "jobs", "children", "metadata", "metrics"):
            assert view[key] == expected["document"][key]
        assert [c["tier"] for c in view["copies"]] == ["t0", "peer", "peer", "region"]
