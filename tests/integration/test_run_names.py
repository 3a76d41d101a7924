"""A run's name by id (service/runs/names.py): read from the catalog once per
process and catalog, then answered without a statement; an unknown id is an
error, never a name."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import NoResultFound

from devsupport import statements
from devsupport.agent import running_agent, write_checkpoint
from tierckpt.service.db import reading
from tierckpt.service.runs.names import name_of_run


async def test_a_run_name_is_read_once_then_kept(catalog_url: str, tmp_path: Path) -> None:
    async with running_agent(catalog_url, tmp_path, start_worker=False) as agent:
        for run in ("alpha", "beta"):
            directory = write_checkpoint(agent.ssd / run, {"w.bin": 10})
            assert (await agent.register(run, 1, directory)).status_code == 202
        async with reading(agent.resources.sessionmaker)() as session:
            ids = {
                name: run_id
                for run_id, name in (await session.execute(text("SELECT id, name FROM runs"))).all()
            }
        with statements.recorded(agent.resources.engine, lambda s: "FROM runs" in s) as reads:
            for _ in range(3):
                for maker in (agent.resources.sessionmaker, reading(agent.resources.sessionmaker)):
                    async with maker() as session:
                        assert await name_of_run(session, ids["alpha"]) == "alpha"
                        assert await name_of_run(session, ids["beta"]) == "beta"
            async with agent.resources.sessionmaker() as session:
                with pytest.raises(NoResultFound):
                    await name_of_run(session, max(ids.values()) + 1000)
        # One read per run, whichever session asked; the unknown id read and refused.
        assert len(reads) == 3
