"""Two regions: register → replicated (east + west) against register → durable
in one region, same checkpoint, same run, alternating.

The second region is a second, independent SeaweedFS server on the same two
cores. With ``[upload] fan_out`` (the default) the agent uploads the T0 files
to both regions at once, each upload hashing what it sends; without it, west
is replicated from east after east commits (streamed, hashed on the way).
Times come from the catalog's own clock (created_at → durable_at / the later
replica's committed_at), so polling adds nothing.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from devsupport.seaweed import SeaweedServer
from tierckpt.client import CheckpointClient

from ..context import BUCKET, VOLUME_SIZE_LIMIT_MB, BenchContext, log, s3_region, settle
from ..data import link_copy
from ..stats import MB, row

NAME = "two_regions"
TITLE = "Two regions: register → replicated vs register → durable (one region)"
REQUIRES: list[str] = []
RUN = "bench-two-regions"
TIMEOUT = 600


def _until(url: str, run: str, step: int, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    with httpx.Client(base_url=url, timeout=30) as http:
        while time.monotonic() < deadline:
            detail: dict[str, Any] = http.get(f"/v1/runs/{run}/checkpoints/{step}").json()
            if detail["state"] == state:
                return detail
            if detail["state"] in ("failed", "corrupt"):
                raise RuntimeError(f"{run}:{step} ended {detail['state']}: {detail['error']}")
            time.sleep(0.1)
    raise RuntimeError(f"{run}:{step} not {state} after {TIMEOUT}s")


def _seconds(start: str, end: str) -> float:
    from datetime import datetime

    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def run(ctx: BenchContext) -> dict[str, Any]:
    west = SeaweedServer(ctx.work / "seaweed-west", volume_size_limit_mb=VOLUME_SIZE_LIMIT_MB)
    west.start()
    try:
        west.create_bucket(BUCKET)
        two = ctx.start_agent(
            "two-regions", regions=[s3_region("east", ctx.seaweed), s3_region("west", west)]
        )
        one_region: list[float] = []
        replicated: list[float] = []
        durable_two: list[float] = []
        # Quick mode: one repetition (one → two regions), to stay short;
        # the full run alternates the order.
        reps = 1 if ctx.quick else max(2, min(ctx.reps, 3))
        for rep in range(reps):
            for label, agent in (
                (("one", ctx.agent), ("two", two))
                if rep % 2 == 0
                else (("two", two), ("one", ctx.agent))
            ):
                settle()
                step = ctx.next_step()
                data = link_copy(ctx.dataset, ctx.ssd / RUN / f"step-{step}")
                with CheckpointClient(agent.url) as client:
                    client.register(RUN, step, data.root)
                if label == "one":
                    detail = _until(agent.url, RUN, step, "durable")
                    one_region.append(
                        _seconds(detail["created_at"][:-1], detail["durable_at"][:-1])
                    )
                else:
                    detail = _until(agent.url, RUN, step, "replicated")
                    # Replicated = the later of the two regions' commits
                    # (with fan-out, west may well commit before east).
                    last_commit = max(r["committed_at"] for r in detail["replicas"])
                    replicated.append(_seconds(detail["created_at"][:-1], last_commit[:-1]))
                    durable_two.append(
                        _seconds(detail["created_at"][:-1], detail["durable_at"][:-1])
                    )
            log(
                f"two regions rep {rep + 1}/{reps}: one region {one_region[-1]:.2f}s, "
                f"replicated {replicated[-1]:.2f}s"
            )
        ctx.stop_agent(two)
    finally:
        west.stop()
    size_mb = ctx.dataset.total_bytes / MB
    ratios = [r / o for r, o in zip(replicated, one_region, strict=True)]
    return {
        "rows": [
            row(
                "one region: register → durable",
                "time",
                "s",
                one_region,
                note=f"{size_mb:.0f} MB, catalog clock",
            ),
            row("two regions: register → durable (east)", "time", "s", durable_two),
            row(
                "two regions: register → replicated (west committed)",
                "time",
                "s",
                replicated,
                ratio_label="replicated / one-region durable",
                ratio_values=ratios,
                note="west: another SeaweedFS server, filled from T0 in parallel (fan-out)",
            ),
        ],
        "notes": ["target: two regions ≤ 1.3× one region"],
        "details": {
            "one_region_s": one_region,
            "replicated_s": replicated,
            "durable_two_s": durable_two,
        },
    }
