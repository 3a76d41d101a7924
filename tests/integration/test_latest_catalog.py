"""`latest` on a catalog written directly (the shape the register path and the
workers leave), on SQLite and PostgreSQL: the answer skips everything
invalid, carries the same shards, files, replicas and children as the detail
view, and the queries behind it use indexes (issue 6: 100,000 checkpoints)."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert
from sqlalchemy.dialects import sqlite

from devsupport import postgres as pg
from devsupport.agent import posix_region, running_agent, write_checkpoint
from tierckpt.service import db
from tierckpt.service.checkpoints import repository as repo
from tierckpt.service.checkpoints.schemas import LatestOut
from tierckpt.service.models import Checkpoint, File, Replica, Run, Shard, utcnow

RUN = "big"
# step -> (checkpoint state, east replica, west replica, quarantined)
SHAPE: dict[int, tuple[str, str, str, bool]] = {
    100: ("replicated", "committed", "committed", False),  # latest in west
    200: ("durable", "committed", "pending", False),  # latest anywhere / in east
    300: ("durable", "committed", "pending", True),  # quarantined
    400: ("corrupt", "corrupt", "pending", False),
    # The state is still durable but the only copy was just marked corrupt:
    # the replica check alone must exclude it.
    500: ("durable", "corrupt", "pending", False),
    600: ("deleted", "deleted", "deleted", False),
    700: ("failed", "pending", "pending", False),
    800: ("uploading", "pending", "pending", False),
    900: ("registered", "pending", "pending", False),
}


async def _seed(agent: Any, ssd_dir: Path) -> None:
    now = utcnow()
    async with agent.resources.sessionmaker() as session:
        run = Run(name=RUN)
        other = Run(name="other")
        session.add_all([run, other])
        await session.flush()
        for n, (step, (state, east, west, quarantined)) in enumerate(sorted(SHAPE.items())):
            checkpoint = Checkpoint(
                run_id=run.id,
                step=step,
                state=state,
                world_size=2,
                parent_run=RUN if step > 100 else None,
                parent_step=step - 100 if step > 100 else None,
                created_at=now + timedelta(seconds=n),
                durable_at=now if east != "pending" else None,
                quarantined_at=now if quarantined else None,
                file_count=4,
                metrics={"loss": step / 64, "tokens": 1e12 + step},
                meta={"note": "é ünïcode", "nested": {"lr": [1, 2.5]}},
                write_seconds=1.25,
                epoch=step // 100,
            )
            session.add(checkpoint)
            await session.flush()
            for rank in (0, 1):
                shard = Shard(
                    checkpoint_id=checkpoint.id,
                    rank=rank,
                    node=f"node-{rank}",
                    path=str(ssd_dir / f"step-{step}" / f"rank-{rank}"),
                    state="uploaded",
                    fingerprint=f"{step:032d}{rank:032d}",
                )
                session.add(shard)
                await session.flush()
                await session.execute(
                    insert(File),
                    [
                        {
                            "shard_id": shard.id,
                            "path": name,
                            "size": 10 + rank,
                            "mtime_ns": 1,
                            "sha256": f"{step:060d}{rank:04d}",
                        }
                        for name in ("z-optim.pt", "a-model.pt")
                    ],
                )
            for region, replica_state in (("east", east), ("west", west)):
                session.add(
                    Replica(
                        checkpoint_id=checkpoint.id,
                        region=region,
                        state=replica_state,
                        uri=f"/{region}/{RUN}/{step}/",
                    )
                )
        # A checkpoint of another run that names step 200 as its parent.
        session.add(
            Checkpoint(run_id=other.id, step=5, state="registered", parent_run=RUN, parent_step=200)
        )
        await session.commit()


async def test_latest_skips_every_invalid_kind_and_matches_the_detail_view(
    catalog_url: str, tmp_path: Path
) -> None:
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", tmp_path / "west")]
    async with running_agent(catalog_url, tmp_path, regions, start_worker=False) as agent:
        await _seed(agent, tmp_path / "ssd")

        answer = await agent.http.get(f"/v1/runs/{RUN}/latest")
        assert answer.status_code == 200, answer.text
        latest = answer.json()
        assert latest["step"] == 200
        assert latest["locations"] == [{"region": "east", "uri": f"/east/{RUN}/200/"}]
        assert latest["local"] is None

        # `latest` writes its JSON without the response models: it must be
        # exactly a LatestOut, and everything but the locations (and the
        # detail view's jobs, copies and peer copies) is the detail view's answer, which is built
        # through the ORM and the models.
        assert LatestOut.model_validate(latest).model_dump(mode="json") == latest
        assert list(latest) == list(LatestOut.model_fields)
        detail = (await agent.http.get(f"/v1/runs/{RUN}/checkpoints/200")).json()
        for key, value in detail.items():
            if key not in ("jobs", "replicas", "copies", "peers", "peer_safe"):
                assert latest[key] == value, key
        assert latest["metrics"] == {"loss": 200 / 64, "tokens": 1e12 + 200}
        assert latest["metadata"]["note"] == "é ünïcode"
        # The pending replica's lag grows between the two answers.
        without_lag = [{**r, "lag_seconds": None} for r in latest["replicas"]]
        assert without_lag == [{**r, "lag_seconds": None} for r in detail["replicas"]]
        assert latest["replicas"][1]["lag_seconds"] > 0
        assert [r["region"] for r in latest["replicas"]] == ["east", "west"]
        assert [(s["rank"], s["node"]) for s in latest["shards"]] == [(0, "node-0"), (1, "node-1")]
        assert [(f["rank"], f["path"]) for f in latest["files"]] == [
            (0, "a-model.pt"),
            (0, "z-optim.pt"),
            (1, "a-model.pt"),
            (1, "z-optim.pt"),
        ]
        assert latest["children"] == [
            {"run": RUN, "step": 300},
            {"run": "other", "step": 5},
        ]

        assert (await agent.http.get(f"/v1/runs/{RUN}/latest?region=east")).json()["step"] == 200
        assert (await agent.http.get(f"/v1/runs/{RUN}/latest?region=west")).json()["step"] == 100

        missing = await agent.http.get("/v1/runs/no-such-run/latest")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "no_valid_checkpoint"
        none_valid = await agent.http.get("/v1/runs/other/latest")
        assert none_valid.status_code == 404
        unknown = await agent.http.get(f"/v1/runs/{RUN}/latest?region=mars")
        assert unknown.status_code == 400
        # The fast path answers these refusals itself (latest_path.py); the
        # route (reached with a parameter only it takes) words them the same.
        for path in ("/v1/runs/other/latest", f"/v1/runs/{RUN}/latest?region=mars"):
            fast = await agent.http.get(path)
            routed = await agent.http.get(path + ("&" if "?" in path else "?") + "scope=durable")
            assert (fast.status_code, fast.json()) == (routed.status_code, routed.json())
            assert fast.headers["content-type"] == routed.headers["content-type"]


async def test_latest_on_this_node_reports_the_intact_local_copy(
    catalog_url: str, tmp_path: Path
) -> None:
    """The local-copy check now reuses the files the answer already loaded."""
    async with running_agent(catalog_url, tmp_path) as agent:
        ckpt = write_checkpoint(agent.ssd / "r" / "s1", {"w.bin": 100, "sub/o.bin": 10})
        assert (await agent.register("r", 1, ckpt)).status_code == 202
        await agent.wait_state("r", 1)
        node = agent.settings.server.node

        here = (await agent.http.get(f"/v1/runs/r/latest?node={node}")).json()
        assert here["local"] == {"node": node, "path": str(ckpt), "ranks": {"0": str(ckpt)}}
        assert (await agent.http.get("/v1/runs/r/latest?node=elsewhere")).json()["local"] is None

        (ckpt / "sub" / "o.bin").write_bytes(b"changed!!!")
        changed = (await agent.http.get(f"/v1/runs/r/latest?node={node}")).json()
        assert changed["step"] == 1 and changed["local"] is None


async def test_latest_on_this_node_lists_every_intact_rank(
    catalog_url: str, tmp_path: Path
) -> None:
    """A multi-rank checkpoint whose ranks were saved on this node: each
    intact rank's T0 directory, so every rank can restore locally."""
    async with running_agent(catalog_url, tmp_path) as agent:
        ranks = {
            rank: write_checkpoint(agent.ssd / "r" / "s2" / f"rank-{rank}", {"w.bin": 100 + rank})
            for rank in range(3)
        }
        for rank, path in ranks.items():
            answer = await agent.register("r", 2, path, rank=rank, world_size=3)
            assert answer.status_code == 202
        await agent.wait_state("r", 2)
        node = agent.settings.server.node

        here = (await agent.http.get(f"/v1/runs/r/latest?node={node}")).json()
        assert here["local"] == {
            "node": node,
            "path": str(ranks[0]),
            "ranks": {str(rank): str(path) for rank, path in ranks.items()},
        }
        # Rank 0's copy changed behind the agent: the others still restore locally.
        (ranks[0] / "w.bin").write_bytes(b"x" * 100)
        partly = (await agent.http.get(f"/v1/runs/r/latest?node={node}")).json()
        assert partly["local"] == {
            "node": node,
            "path": None,
            "ranks": {"1": str(ranks[1]), "2": str(ranks[2])},
        }


def _plan(database: Path, statement: Any) -> str:
    sql = str(statement.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
    with sqlite3.connect(database) as connection:
        rows = connection.execute(f"EXPLAIN QUERY PLAN {sql}").fetchall()
    return "\n".join(str(r[-1]) for r in rows)


async def test_latest_queries_use_indexes_not_scans(tmp_path: Path) -> None:
    """At 100,000 checkpoints a scan of `checkpoints` is tens of milliseconds:
    the latest walk and the children lookup must both be index searches."""
    database = tmp_path / "catalog.db"
    url = f"sqlite+aiosqlite:///{database}"
    async with running_agent(url, tmp_path, start_worker=False):
        pass
    # The statements `latest` runs (repository.latest_rows).
    plans = {
        name: _plan(database, statement)
        for name, statement in {
            "latest": repo.LATEST_STATEMENTS[False].params(run=RUN, min_regions=1),
            "latest_region": repo.LATEST_STATEMENTS[True].params(
                run=RUN, min_regions=1, region="west"
            ),
            "children": repo.CHILDREN.params(run=RUN, step=200),
            "shards_with_files": repo.SHARDS_WITH_FILES.params(checkpoint_id=1),
        }.items()
    }
    for name, plan in plans.items():
        assert "SCAN checkpoints" not in plan, (name, plan)
        assert "SCAN replicas" not in plan, (name, plan)
        assert "SCAN files" not in plan, (name, plan)
    # Highest step first straight from the (run_id, step) index: no sort of
    # the run. The one sort allowed comes after the walk: the answer's few
    # replica rows, by id.
    walk = plans["latest"].split("SCAN latest")[0]
    assert "CO-ROUTINE latest" in walk and "TEMP B-TREE" not in walk, plans["latest"]
    assert "ix_checkpoints_parent" in plans["children"], plans["children"]
    # latest reads the children in the same statement, through the same index.
    assert "ix_checkpoints_parent" in plans["latest"], plans["latest"]


@pytest.mark.postgres
@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("socket_noticed", [True, False], ids=["closed-socket", "silent-death"])
async def test_latest_survives_its_read_connections_being_killed(
    catalog_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    socket_noticed: bool,
) -> None:
    """The read pool pings only connections idle for a while (db._ping_when_idle).
    A recently used one the server has since killed is either known closed
    (the usual case: the socket said so) and replaced at checkout, or, when
    nothing noticed yet, fails its statement, and the read is tried once
    more on a fresh connection. Either way the caller gets its answer, not a
    503, right after the catalog dropped every connection (a restart, a
    failover, pg_terminate_backend)."""
    regions = [posix_region("east", tmp_path / "east"), posix_region("west", tmp_path / "west")]
    async with running_agent(catalog_url, tmp_path, regions, start_worker=False) as agent:
        await _seed(agent, tmp_path / "ssd")
        for _ in range(3):  # a warm pool, every connection just used
            assert (await agent.http.get(f"/v1/runs/{RUN}/latest")).status_code == 200
        if not socket_noticed:
            # Nothing noticed at checkout: the statement itself hits the end.
            monkeypatch.setattr(db, "known_closed", lambda _connection: False)
        assert pg.terminate_connections(catalog_url) >= 1
        await asyncio.sleep(0.2)  # the sockets' end reaches the event loop

        answer = await agent.http.get(f"/v1/runs/{RUN}/latest")
        assert answer.status_code == 200, answer.text
        assert answer.json()["step"] == 200
