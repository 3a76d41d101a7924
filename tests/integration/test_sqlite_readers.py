"""On SQLite, requests that only read do not queue behind the writer."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from devsupport.agent import running_agent, write_checkpoint


async def test_get_answers_while_another_connection_holds_the_write_lock(tmp_path: Path) -> None:
    database = tmp_path / "catalog.db"
    url = f"sqlite+aiosqlite:///{database}"
    async with running_agent(url, tmp_path, start_worker=False) as agent:
        ckpt = write_checkpoint(agent.ssd / "s1", {"w.bin": b"w"})
        assert (await agent.register("r", 1, ckpt)).status_code == 202

        # Another process's long write transaction (a rebuild, a migration, a
        # stuck agent): it holds SQLite's write lock for a while.
        holder = sqlite3.connect(database, isolation_level=None, timeout=1)
        holder.execute("BEGIN IMMEDIATE")
        try:
            began = time.monotonic()
            answer = await asyncio.wait_for(agent.http.get("/v1/runs/r/checkpoints/1"), 10)
            listed = await asyncio.wait_for(agent.http.get("/v1/runs/r/checkpoints"), 10)
            elapsed = time.monotonic() - began
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert answer.status_code == 200 and answer.json()["step"] == 1
        assert listed.status_code == 200
        # A reader that took the write lock would wait for the holder (the
        # busy timeout is 30 s); a snapshot reader answers at once.
        assert elapsed < 5, f"GET waited {elapsed:.1f}s behind the writer"

        # Writes still take the lock and still succeed once it is free.
        ckpt2 = write_checkpoint(agent.ssd / "s2", {"w.bin": b"v"})
        assert (await agent.register("r", 2, ckpt2)).status_code == 202
