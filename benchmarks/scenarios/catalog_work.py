"""Catalog transactions per checkpoint, on PostgreSQL (where the catalog is
shared by every node's agent, and its work is every node's cost).

An agent with its defaults (worker on, poll interval 0.5 s), two regions (two
prefixes of the benchmark's SeaweedFS), its own PostgreSQL database. First
idle: transactions per second with nothing to do (the worker's claims, the
passes). Then ``COUNT`` checkpoints of two 64 KiB files registered back to
back: transactions from the first registration until ``GRACE_SECONDS``
after the last is replicated (long enough for a replicate job held back as
a safety net behind an upload from T0 to have run), minus the idle rate over
the same time, per checkpoint. Counted by the server (`pg_stat_database`:
commits and rollbacks of the database), so every agent-side path is in it.
With ``--quick`` the grace is not waited for.
"""

from __future__ import annotations

import time
from typing import Any

from devsupport import postgres as pg
from tierckpt.client import CheckpointClient

from ..context import BenchContext, log, s3_region
from ..data import write_random
from ..stats import row

NAME = "catalog_work"
TITLE = "Catalog transactions per checkpoint, PostgreSQL (lower is better)"
REQUIRES: tuple[str, ...] = ()
RUN = "bench-catalog-work"
COUNT = 30
FILE_BYTES = 64 * 1024
IDLE_SECONDS = 20.0
# Above kinds.FAN_OUT_GRACE_SECONDS (30 s).
GRACE_SECONDS = 40.0
TIMEOUT = 300.0


def _transactions(url: str, settle_seconds: float = 1.5) -> tuple[int, float]:
    """The database's commits + rollbacks so far, and when; ``settle_seconds``
    is waited first, for the sessions to report theirs
    (``pg.transaction_count``)."""
    time.sleep(settle_seconds)
    return pg.transaction_count(url), time.monotonic()


def run(ctx: BenchContext) -> dict[str, Any]:
    if not pg.postgres_available():
        return {"rows": [], "notes": ["skipped: no PostgreSQL reachable"], "details": {}}
    url = pg.create_temp_database(pg.postgres_admin_url())
    regions = [
        s3_region("east", ctx.seaweed, prefix="catalog-work-east"),
        s3_region("west", ctx.seaweed, prefix="catalog-work-west"),
    ]
    agent = ctx.start_agent("catalog-work", regions=regions, catalog={"url": url})
    try:
        time.sleep(2.0)  # past the agent's start
        before_idle, idle_began = _transactions(url)
        time.sleep(IDLE_SECONDS)
        after_idle, idle_ended = _transactions(url)
        idle_rate = (after_idle - before_idle) / (idle_ended - idle_began)
        sources = []
        for step in range(COUNT):
            directory = ctx.ssd / RUN / f"step-{step}"
            for name in ("model.bin", "optimizer.bin"):
                write_random(directory / name, FILE_BYTES)
            sources.append(directory)
        with CheckpointClient(agent.url) as client:
            for step, directory in enumerate(sources):
                client.register(RUN, step, directory)
            client.wait(RUN, COUNT - 1, state="replicated", timeout=TIMEOUT, poll_interval=0.2)
        if not ctx.quick:
            time.sleep(GRACE_SECONDS)
        # Idle connections (the registration writer's) report within 10 s.
        after, ended = _transactions(url, settle_seconds=11.0)
    finally:
        ctx.stop_agent(agent)
        pg.drop_database(url, pg.postgres_admin_url())
    per_checkpoint = ((after - after_idle) - idle_rate * (ended - idle_ended)) / COUNT
    log(f"catalog work: idle {idle_rate:.2f}/s, {per_checkpoint:.1f} transactions per checkpoint")
    grace = "not waited for (--quick)" if ctx.quick else f"{GRACE_SECONDS:.0f} s"
    return {
        "rows": [
            row("idle agent (worker on, nothing to do)", "transactions/s", "1/s", [idle_rate]),
            row(
                f"{COUNT} checkpoints of 2 files, 2 regions, back to back",
                "transactions per checkpoint above idle",
                "count",
                [per_checkpoint],
                note=f"until replicated, then a grace of {grace}",
            ),
        ],
        "notes": [
            "PostgreSQL's own count (pg_stat_database: commits + rollbacks of the agent's "
            "database); the agent's defaults (poll interval 0.5 s)"
        ],
        "details": {"idle_rate": idle_rate, "per_checkpoint": per_checkpoint},
    }
