"""Registrations per second: 64 concurrent clients against one agent on
SQLite, one agent on PostgreSQL, and two agents (two nodes) sharing one
PostgreSQL catalog.

The agents run with their workers off (``TIERCKPT_WORKER__ENABLED=false``):
this measures the register path (list the directory, the group-committed
catalog transaction, enqueue the upload), not the uploads. Every
registration is a new (run, step) with a one-file directory, so each is a
real insert, and a 202 means it is committed.

The 64 clients are 64 keep-alive HTTP/1.1 connections driven by a minimal
asyncio client (below), not httpx: on the 2-core machine this runs on, an
httpx request costs several times the agent's own CPU per registration, so
the figure would measure the client. All clients come from 127.0.0.1, one
caller for the agent's per-caller rate limit (200/s by default), so the
limit is raised here rather than measuring 429s; the middleware still runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from devsupport import postgres as pg

from ..context import BenchContext, log
from ..stats import percentile, row

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


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> tuple[int, bytes]:
    writer.write(
        b"POST /v1/checkpoints HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def _hammer(urls: list[str], dirs: list[Path], run: str) -> tuple[float, int, list[float]]:
    """(seconds, non-202 answers, per-request latencies in ms)."""
    queue: asyncio.Queue[tuple[int, Path]] = asyncio.Queue()
    for step, d in enumerate(dirs):
        queue.put_nowait((step, d))
    failures = 0
    latencies: list[float] = []
    targets = [urlsplit(u) for u in urls]

    async def client(n: int) -> None:
        nonlocal failures
        target = targets[n % len(targets)]
        reader, writer = await asyncio.open_connection(target.hostname, target.port)
        try:
            while True:
                try:
                    step, d = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = json.dumps({"run": run, "step": step, "path": str(d)}).encode()
                began = time.perf_counter()
                status, answer = await _post(reader, writer, body)
                latencies.append((time.perf_counter() - began) * 1000)
                if status != 202:
                    failures += 1
                    if failures <= 3:
                        log(f"register answered {status}: {answer[:200]!r}")
        finally:
            writer.close()

    began = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(CLIENTS)))
    return time.perf_counter() - began, failures, latencies


def run(ctx: BenchContext) -> dict[str, Any]:
    # At 600-1000/s a quick rep takes 1-1.7 s per setup: long enough to be
    # more than the warm-up (first batches, connection set-up), short for
    # `make bench QUICK=1`.
    count = 1000 if ctx.quick else 4000
    admin = pg.postgres_admin_url()
    shared_db = pg.create_temp_database(admin)
    single_db = pg.create_temp_database(admin)
    # One address for all 64 clients: see the module docstring.
    server = {"rate_limit_per_second": 1_000_000, "rate_limit_burst": 1_000_000}
    setups = {
        "sqlite": "one agent, SQLite catalog (synchronous=FULL)",
        "pg1": "one agent, PostgreSQL catalog",
        "pg2": "two agents, one PostgreSQL catalog",
    }
    rates: dict[str, list[float]] = {key: [] for key in setups}
    p99s: dict[str, list[float]] = {key: [] for key in setups}
    failures = 0
    try:
        started = ctx.start_agents(
            {
                "rate-sqlite": {"worker": False, "server": {**server, "node": "rate-s"}},
                "rate-pg1": {"worker": False, "catalog": {"url": single_db}, "server": server},
                **{
                    f"rate-{n}": {
                        "worker": False,
                        "catalog": {"url": shared_db},
                        "server": {**server, "node": f"rate-node-{n}"},
                    }
                    for n in range(2)
                },
            }
        )
        agents = {
            "sqlite": [started["rate-sqlite"]],
            "pg1": [started["rate-pg1"]],
            "pg2": [started["rate-0"], started["rate-1"]],
        }
        reps = max(2, min(ctx.reps, 3))
        for rep in range(reps):
            dirs = _dirs(ctx.ssd / "rate" / f"rep{rep}", count)
            for key, group in agents.items():
                seconds, failed, latencies = asyncio.run(
                    _hammer([a.url for a in group], dirs, f"rate-{key}-{rep}")
                )
                failures += failed
                rates[key].append(count / seconds)
                p99s[key].append(percentile(latencies, 99))
            log(
                f"rate rep {rep + 1}/{reps}: "
                + ", ".join(f"{setups[k]} {rates[k][-1]:.0f}/s" for k in setups)
            )
        for group in agents.values():
            for agent in group:
                ctx.stop_agent(agent)
    finally:
        pg.drop_database(shared_db, admin)
        pg.drop_database(single_db, admin)
    rows: list[dict[str, Any]] = []
    for key, label in setups.items():
        rows.append(
            row(
                label,
                "rate",
                "reg/s",
                rates[key],
                note=f"{count} registrations, {CLIENTS} concurrent clients" if not rows else "",
            )
        )
    for key, label in setups.items():
        rows.append(row(label, "p99 under load", "ms", p99s[key]))
    return {
        "rows": rows,
        "notes": [
            f"non-202 answers: {failures}",
            "target: ≥ 500 registrations/s with 64 concurrent clients",
            "group commit: one catalog transaction (one fsync) per batch of the "
            "registrations pending at the agent; each is answered after that commit",
        ],
        "details": {"rates": rates, "p99_ms": p99s, "count": count},
    }
