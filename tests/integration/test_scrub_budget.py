"""The scrubber's pass (integrity/scrub.py): the stalest committed replicas
first, as many as its byte budget covers, queued as verify jobs in short
transactions of a few rows each (one transaction for a whole budget of small
checkpoints held the SQLite write lock for 60-150 ms, and a registration
waited that long)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from devsupport.agent import running_agent, write_checkpoint
from tierckpt.service.config import ScrubSettings
from tierckpt.service.integrity import scrub
from tierckpt.service.models import Checkpoint, Job, JobKind, Run

FILE_BYTES = 1000


async def _verify_jobs(agent: Any) -> dict[int, int]:
    """Step -> how many verify jobs it has (any state)."""
    async with agent.resources.sessionmaker() as session:
        rows = await session.execute(
            select(Checkpoint.step)
            .join(Job, Job.checkpoint_id == Checkpoint.id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Run.name == "llm", Job.kind == JobKind.VERIFY)
        )
        out: dict[int, int] = {}
        for (step,) in rows:
            out[step] = out.get(step, 0) + 1
        return out


async def test_scrub_queues_the_stalest_within_its_budget_a_few_rows_per_transaction(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scrub, "ENQUEUE_CHUNK", 2)
    transactions: list[int] = []
    giving_way = scrub.transaction_giving_way

    async def counted(sessionmaker: Any, body: Any) -> Any:
        transactions.append(len(body.keywords["rows"]))
        return await giving_way(sessionmaker, body)

    monkeypatch.setattr(scrub, "transaction_giving_way", counted)
    # The agent's own scrubber off: this test runs the pass itself.
    async with running_agent(catalog_url, tmp_path, scrub={"enabled": False}) as agent:
        for step in range(1, 6):
            ckpt = write_checkpoint(agent.ssd / f"s{step}", {"w.bin": FILE_BYTES})
            assert (await agent.register("llm", step, ckpt)).status_code == 202
            # One at a time: committed in step order, so step 1 is the stalest.
            await agent.wait_state("llm", step)
        before = await _verify_jobs(agent)

        # A budget of three checkpoints' bytes in this pass.
        settings = ScrubSettings(
            interval_seconds=3600, bytes_per_hour=3 * FILE_BYTES, min_age_hours=0.0
        )
        queued = await scrub.Scrubber(agent.resources, settings).tick()

        after = await _verify_jobs(agent)
        added = {step: after.get(step, 0) - before.get(step, 0) for step in range(1, 6)}
        assert queued == 3
        assert added == {1: 1, 2: 1, 3: 1, 4: 0, 5: 0}
        # Three rows: two transactions of at most ENQUEUE_CHUNK rows.
        assert transactions == [2, 1]


async def test_scrub_takes_at_least_one_replica_larger_than_its_budget(
    catalog_url: str, tmp_path: Path
) -> None:
    async with running_agent(catalog_url, tmp_path, scrub={"enabled": False}) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": FILE_BYTES})
        assert (await agent.register("llm", 1, ckpt)).status_code == 202
        await agent.wait_state("llm", 1)
        before = await _verify_jobs(agent)
        settings = ScrubSettings(interval_seconds=3600, bytes_per_hour=1, min_age_hours=0.0)
        assert await scrub.Scrubber(agent.resources, settings).tick() == 1
        after = await _verify_jobs(agent)
        assert after.get(1, 0) - before.get(1, 0) == 1
