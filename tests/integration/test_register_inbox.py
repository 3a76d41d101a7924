"""The registration inbox (service/checkpoints/inbox.py), on both catalogs.

A new checkpoint's registration is answered once recorded on the node,
before the catalog's write: shown here with the catalog's write lock held
from outside the agent the whole time (a background transaction that never
ends), where a registration answered at its commit could not be answered.
The catalog's refusals stay synchronous; the record reaches the catalog,
and the checkpoint becomes durable, once the lock is released.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from devsupport.agent import RECORDED, running_agent, write_checkpoint
from devsupport.catalog_lock import catalog_write_lock, rows
from tierckpt.service.checkpoints.inbox_journal import pending_records


def _records(agent_inbox: Path) -> list[dict[str, Any]]:
    return pending_records(agent_inbox)


async def test_register_is_answered_while_the_catalog_write_lock_is_held(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, catalog=RECORDED) as agent:
        inbox = agent.process.inbox
        assert inbox is not None  # the default on SQLite
        first = write_checkpoint(agent.ssd / "step-1", {"model.bin": 10_000, "opt.bin": 3})
        other = write_checkpoint(agent.ssd / "other", {"model.bin": 20_000})
        with catalog_write_lock(catalog_url):
            answer = await asyncio.wait_for(agent.register("inbox", 1, first, settle=False), 30)
            assert answer.status_code == 202, answer.text
            body = answer.json()
            assert (body["state"], body["total_bytes"], body["file_count"]) == (
                "registered",
                10_003,
                2,
            )
            assert [r["state"] for r in body["replicas"]] == ["pending"]
            # Answered before the catalog holds it: its write waits for the lock.
            assert rows(catalog_url, "SELECT count(*) FROM checkpoints") == [(0,)]
            assert len(inbox) == 1 and len(_records(inbox.directory)) == 1
            # The catalog's refusals are still the answer's: other content
            # for the recorded rank, another world size.
            refused = await agent.register("inbox", 1, other, settle=False)
            assert refused.status_code == 409, refused.text
            assert "different content" in refused.json()["error"]["message"]
            refused = await agent.register("inbox", 1, other, settle=False, rank=1, world_size=2)
            assert refused.status_code == 409 and "world_size" in refused.json()["error"]["message"]
            # Its detail, while the catalog cannot have it, from the record.
            detail = await agent.http.get("/v1/runs/inbox/checkpoints/1")
            assert detail.status_code == 200 and detail.json()["state"] == "registered"
        # Lock released: the record goes to the catalog, then is removed.
        done = await agent.wait_state("inbox", 1)
        assert done["total_bytes"] == 10_003
        assert len(inbox) == 0 and _records(inbox.directory) == []
        # A repeat of the same content: already registered.
        again = await agent.register("inbox", 1, first)
        assert again.status_code == 200 and again.json()["state"] in ("durable", "replicated")


async def test_a_checkpoint_the_catalog_holds_is_refused_or_added_as_before(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=RECORDED) as agent:
        inbox = agent.process.inbox
        assert inbox is not None
        rank0 = write_checkpoint(agent.ssd / "r0", {"w.bin": 100})
        rank1 = write_checkpoint(agent.ssd / "r1", {"w.bin": 200})
        other = write_checkpoint(agent.ssd / "other", {"w.bin": 300})
        answer = await agent.register("two", 5, rank0, settle=False, rank=0, world_size=2)
        assert answer.status_code == 202
        assert await inbox.settled("two", 5)
        # Another rank of a checkpoint in the catalog: written, then answered.
        answer = await agent.register("two", 5, rank1, rank=1, world_size=2)
        assert answer.status_code == 202, answer.text
        assert sorted(s["rank"] for s in answer.json()["shards"]) == [0, 1]
        refused = await agent.register("two", 5, other, rank=1, world_size=2)
        assert refused.status_code == 409
        listed = await agent.http.get("/v1/runs/two/checkpoints")
        assert [c["step"] for c in listed.json()["checkpoints"]] == [5]


async def test_listings_wait_for_the_records_they_would_miss(
    catalog_url: str, tmp_path: Path
) -> None:
    """Read your own registrations: a run answered from the inbox a moment ago
    is in the runs listing, the dashboard's and its own checkpoints listing,
    which wait for its record to reach the catalog rather than answer
    without it."""
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=RECORDED) as agent:
        path = write_checkpoint(agent.ssd / "fresh", {"w.bin": 100})
        with catalog_write_lock(catalog_url):
            answer = await agent.register("fresh-run", 1, path, settle=False)
            assert answer.status_code == 202, answer.text
            reads = [
                asyncio.create_task(agent.http.get(url))
                for url in ("/v1/runs", "/ui", "/v1/runs/fresh-run/checkpoints")
            ]
            await asyncio.sleep(0.5)
            # Lock-free reads would have answered by now, without the run.
            assert not any(read.done() for read in reads)
        runs, page, checkpoints = [await asyncio.wait_for(read, 30) for read in reads]
        assert [r["run"] for r in runs.json()["runs"]] == ["fresh-run"], runs.text
        assert page.status_code == 200 and "fresh-run" in page.text
        assert [c["step"] for c in checkpoints.json()["checkpoints"]] == [1]


async def test_the_ranks_of_a_new_checkpoint_recorded_together(
    catalog_url: str, tmp_path: Path
) -> None:
    """Ranks arriving while the first is still recorded only: each is decided
    against the others, and all reach the catalog as one checkpoint."""
    async with running_agent(catalog_url, tmp_path, start_worker=False, catalog=RECORDED) as agent:
        dirs = [write_checkpoint(agent.ssd / f"r{rank}", {"w.bin": 10 + rank}) for rank in range(3)]
        with catalog_write_lock(catalog_url):
            for rank, path in enumerate(dirs):
                answer = await agent.register(
                    "ranks", 7, path, settle=False, rank=rank, world_size=3
                )
                assert answer.status_code == 202, answer.text
                assert len(answer.json()["shards"]) == rank + 1
            clash = await agent.register("ranks", 7, dirs[0], settle=False, rank=1, world_size=3)
            assert clash.status_code == 409
        assert await agent.process.inbox.settled("ranks", 7)  # type: ignore[union-attr]
        detail = (await agent.http.get("/v1/runs/ranks/checkpoints/7")).json()
        assert sorted(s["rank"] for s in detail["shards"]) == [0, 1, 2]
        assert detail["total_bytes"] == 33


async def test_the_default_is_the_inbox_on_sqlite_the_commit_on_postgresql(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        recorded = agent.settings.catalog.is_sqlite
        assert (agent.process.inbox is not None) == recorded
        assert agent.settings.catalog.answer_at == ("recorded" if recorded else "committed")


async def test_register_ack_committed_answers_at_the_commit(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(
        catalog_url, tmp_path, start_worker=False, catalog={"register_ack": "committed"}
    ) as agent:
        assert agent.process.inbox is None
        source = write_checkpoint(agent.ssd / "s", {"w.bin": 10})
        answer = await agent.register("c", 1, source)
        assert answer.status_code == 202
        assert rows(catalog_url, "SELECT count(*) FROM checkpoints") == [(1,)]
        assert not (agent.ssd / ".tierckpt-inbox").exists()
