"""The agent's CPU per small checkpoint, from register to the end of its life.

Every checkpoint costs the agent a fixed amount of work besides its bytes:
the register, catalog transactions (claims, commits, replica rows), S3
requests (the manifest, a copy into the second region, the deletions),
retention's plan. For a large checkpoint that is lost in the per-GB cost
(`cpu`); for small ones, many runs on one node or frequent saves, it is the
cost, and in `register_latency` it is most of the background work the timed
registrations meet: each back-to-back round registers about 600 4 KiB
checkpoints of its own.

Three agents with the SQLite catalog and otherwise their defaults (the
worker in a process of its own, a child of the agent), one after the other,
each given ``COUNT`` checkpoints of one 4 KiB file back to back and measured
until its worker has nothing left to do (no queued or running job in its
``/metrics``):

1. one region, nothing deleted: register, upload, commit;
2. two regions (two prefixes of the benchmark's SeaweedFS): the copy into
   the second;
3. two regions and retention (``keep_last`` 4 in the regions, 2 on T0, a
   pass every 2 s, as in `register_latency`): every checkpoint but the
   newest four also deleted from both regions and T0.

CPU seconds from /proc of the agent and its worker process, and of the
SeaweedFS server, with each one's idle rate (measured for ``IDLE_SECONDS``
before) taken off, per checkpoint. Stages 2 and 3 are also given as ratios
to stage 1 (what the second region and retention add).
"""

from __future__ import annotations

import time
from typing import Any

from tierckpt.client import CheckpointClient

from ..context import Agent, BenchContext, log, s3_region
from ..data import write_random
from ..procstat import cpu_seconds, tree_cpu_seconds
from ..stats import row
from ..worker_queue import busy_jobs

NAME = "worker_cost"
TITLE = "Agent CPU per small checkpoint, register to end of life (ms; lower is better)"
REQUIRES: tuple[str, ...] = ()
COUNT = 150
FILE_BYTES = 4096
IDLE_SECONDS = 8.0
TIMEOUT = 600.0
# After the worker's queue is empty: a retention pass (every 2 s) evicting T0.
SETTLE_SECONDS = 5.0
STAGES: tuple[tuple[str, dict[str, bool]], ...] = (
    ("one region", {}),
    ("two regions", {"two_regions": True}),
    ("two regions, retention deleting", {"two_regions": True, "retention": True}),
)


def _wait_idle(agent: Agent, timeout: float) -> float:
    """Until the worker has had nothing to do for two polls in a row; the seconds waited."""
    began = time.monotonic()
    quiet = 0
    while time.monotonic() - began < timeout:
        quiet = quiet + 1 if busy_jobs(agent.url) == 0 else 0
        if quiet >= 2:
            return time.monotonic() - began
        time.sleep(0.5)
    raise TimeoutError(f"the worker still had jobs after {timeout:.0f} s")


def _stage(
    ctx: BenchContext, rep: int, label: str, two_regions: bool = False, retention: bool = False
) -> dict[str, float]:
    name = f"worker-cost-{rep}-{int(two_regions)}{int(retention)}"
    regions = [s3_region("east", ctx.seaweed, prefix=f"{name}-east")]
    if two_regions:
        regions.append(s3_region("west", ctx.seaweed, prefix=f"{name}-west"))
    overrides: dict[str, Any] = {}
    if retention:
        overrides["retention"] = {"keep_last": 4, "interval_seconds": 2.0}
        overrides["local"] = {"keep_last": 2}
    count = 40 if ctx.quick else COUNT
    sources = []
    for step in range(count):
        directory = ctx.ssd / name / f"step-{step}"
        write_random(directory / "weights.bin", FILE_BYTES)
        sources.append(directory)
    agent = ctx.start_agent(name, regions=regions, **overrides)
    try:
        time.sleep(2.0)  # past the agent's start
        weed = ctx.seaweed.pid or 0

        def marks() -> tuple[float, float, float]:
            return tree_cpu_seconds(agent.pid), cpu_seconds(weed), time.monotonic()

        a0, w0, t0 = marks()
        time.sleep(IDLE_SECONDS)
        a1, w1, t1 = marks()
        agent_idle, weed_idle = (a1 - a0) / (t1 - t0), (w1 - w0) / (t1 - t0)
        with CheckpointClient(agent.url) as client:
            for step, directory in enumerate(sources):
                client.register(name, step, directory)
        waited = _wait_idle(agent, TIMEOUT)
        time.sleep(SETTLE_SECONDS)
        a2, w2, t2 = marks()
    finally:
        ctx.stop_agent(agent)
    elapsed = t2 - t1
    agent_ms = ((a2 - a1) - agent_idle * elapsed) * 1000 / count
    weed_ms = ((w2 - w1) - weed_idle * elapsed) * 1000 / count
    log(
        f"worker cost, {label}: agent {agent_ms:.1f} ms, SeaweedFS {weed_ms:.1f} ms per "
        f"checkpoint ({count} in {waited:.1f} s)"
    )
    return {"agent_ms": agent_ms, "weed_ms": weed_ms, "seconds": waited, "count": count}


def run(ctx: BenchContext) -> dict[str, Any]:
    reps = 1 if ctx.quick else max(1, min(ctx.reps, 2))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in STAGES}
    for rep in range(reps):
        for label, options in STAGES:
            results[label].append(_stage(ctx, rep, label, **options))
    base = [r["agent_ms"] for r in results[STAGES[0][0]]]
    rows = []
    for index, (label, _) in enumerate(STAGES):
        agent_ms = [r["agent_ms"] for r in results[label]]
        ratios = [a / b for a, b in zip(agent_ms, base, strict=True)] if index else None
        rows.append(
            row(
                f"{label}: agent + its worker",
                "CPU per checkpoint",
                "ms",
                agent_ms,
                note=f"{results[label][0]['count']:.0f} checkpoints of one 4 KiB file, "
                f"worker idle after {min(r['seconds'] for r in results[label]):.0f}-"
                f"{max(r['seconds'] for r in results[label]):.0f} s",
                ratio_label=f"× {STAGES[0][0]}" if ratios else None,
                ratio_values=ratios,
            )
        )
        rows.append(
            row(
                f"{label}: SeaweedFS",
                "CPU per checkpoint",
                "ms",
                [r["weed_ms"] for r in results[label]],
            )
        )
    return {
        "rows": rows,
        "notes": [
            "SQLite catalog, the agent's defaults (the worker in a child process); CPU of "
            "the agent, its worker process, and SeaweedFS from /proc, each "
            "one's idle rate taken off; measured until no job is queued or running"
        ],
        "details": results,
    }
