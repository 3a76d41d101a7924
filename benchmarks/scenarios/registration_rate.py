"""Registrations per second: 64 concurrent clients against two agents (two
nodes) sharing one PostgreSQL catalog, and against one agent on SQLite.

The agents run with their workers off (``TIERCKPT_WORKER__ENABLED=false``):
this measures the register path (list the directory, one catalog
transaction, enqueue the upload), not the uploads. Every registration is a
new (run, step) with a one-file directory, so each is a real insert.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support import postgres as pg

from ..context import BenchContext, log
from ..stats import row

NAME = "registration_rate"
TITLE = "Registrations per second (64 concurrent clients; higher is better)"
REQUIRES: tuple[str, ...] = ()
CLIENTS = 64


def _dirs(base: Path, count: int) -> list[Path]:
    dirs = []
    for i in range(count):
        d = base / f"c{i:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "w.bin").write_bytes(b"x" * 64)
        dirs.append(d)
    return dirs


async def _hammer(urls: list[str], dirs: list[Path], run: str) -> tuple[float, int]:
    queue: asyncio.Queue[tuple[int, Path]] = asyncio.Queue()
    for step, d in enumerate(dirs):
        queue.put_nowait((step, d))
    failures = 0
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    clients = [httpx.AsyncClient(base_url=u, timeout=60, limits=limits) for u in urls]

    async def worker(n: int) -> None:
        nonlocal failures
        http = clients[n % len(clients)]
        while True:
            try:
                step, d = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            answer = await http.post(
                "/v1/checkpoints", json={"run": run, "step": step, "path": str(d)}
            )
            if answer.status_code != 202:
                failures += 1

    began = time.perf_counter()
    try:
        await asyncio.gather(*(worker(n) for n in range(CLIENTS)))
    finally:
        for client in clients:
            await client.aclose()
    return time.perf_counter() - began, failures


def run(ctx: BenchContext) -> dict[str, Any]:
    count = 600 if ctx.quick else 2000
    admin = pg.postgres_admin_url()
    database = pg.create_temp_database(admin)
    rates_pg: list[float] = []
    rates_sqlite: list[float] = []
    failures = 0
    try:
        catalog = {"url": database}
        agents = [
            ctx.start_agent(
                f"rate-{n}", worker=False, catalog=catalog, server={"node": f"rate-node-{n}"}
            )
            for n in range(2)
        ]
        single = ctx.start_agent("rate-sqlite", worker=False)
        reps = max(2, min(ctx.reps, 3))
        for rep in range(reps):
            dirs = _dirs(ctx.ssd / "rate" / f"rep{rep}", count)
            seconds, failed = asyncio.run(_hammer([a.url for a in agents], dirs, f"rate-pg-{rep}"))
            failures += failed
            rates_pg.append(count / seconds)
            seconds, failed = asyncio.run(_hammer([single.url], dirs, f"rate-sqlite-{rep}"))
            failures += failed
            rates_sqlite.append(count / seconds)
            log(
                f"rate rep {rep + 1}/{reps}: two agents/PostgreSQL {rates_pg[-1]:.0f}/s, "
                f"one agent/SQLite {rates_sqlite[-1]:.0f}/s"
            )
        for agent in (*agents, single):
            ctx.stop_agent(agent)
    finally:
        pg.drop_database(database, admin)
    return {
        "rows": [
            row(
                "two agents, one PostgreSQL catalog",
                "rate",
                "reg/s",
                rates_pg,
                note=f"{count} registrations, {CLIENTS} concurrent clients",
            ),
            row("one agent, SQLite catalog (synchronous=FULL)", "rate", "reg/s", rates_sqlite),
        ],
        "notes": [f"non-202 answers: {failures}", "target (issue 6): ≥ 500 registrations/s"],
        "details": {"postgres": rates_pg, "sqlite": rates_sqlite, "count": count},
    }
