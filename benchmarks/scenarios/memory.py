"""Peak RSS of an agent while it uploads a 10 GiB checkpoint (1 GiB with --quick).

A fresh agent (its own catalog, same SeaweedFS region, dedup off) uploads one
sparse file of that size: the agent still reads, hashes and sends every byte
(the zeros cost no disk on either side, SeaweedFS stores them compressed), so
this measures what the pipeline holds, not the dataset. VmHWM (peak resident
set since start) of the agent and of its worker process, which holds the
upload buffers, summed, is read after the checkpoint is durable; the
target is ≤ 512 MB whatever the size. The checkpoint is deleted afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tierckpt.client import CheckpointClient

from ..context import BenchContext, log, settle
from ..data import sparse_file
from ..procstat import tree_memory_kib
from ..stats import row

GiB = 1024**3

NAME = "memory"
TITLE = "Agent peak RSS while uploading one large checkpoint (MiB, lower is better)"
REQUIRES: tuple[str, ...] = ()
RUN = "bench-memory"
TARGET_MB = 512
TIMEOUT = 1800


def run(ctx: BenchContext) -> dict[str, Any]:
    size = (1 if ctx.quick else 10) * 1024**3
    agent = ctx.start_agent("memory")
    try:
        path = sparse_file(ctx.ssd / RUN / "step-1" / "model.bin", size)
        idle = tree_memory_kib(agent.pid)
        settle()
        began = time.perf_counter()
        with (
            CheckpointClient(agent.url) as client,
            httpx.Client(base_url=agent.url, timeout=30) as http,
        ):
            client.register(RUN, 1, path.parent)
            deadline = time.monotonic() + TIMEOUT
            while True:
                state = http.get(f"/v1/runs/{RUN}/checkpoints/1").json()["state"]
                if state in ("durable", "replicated"):
                    break
                if state in ("failed", "corrupt") or time.monotonic() > deadline:
                    raise RuntimeError(f"{RUN}:1 ended {state}")
                time.sleep(0.5)
            seconds = time.perf_counter() - began
            peak = tree_memory_kib(agent.pid)
            # Frees SeaweedFS's space (no admin token: the bench agent has no auth).
            http.delete(f"/v1/runs/{RUN}/checkpoints/1", params={"force": "true"})
        peak_mib = peak["VmHWM"] / 1024
        log(f"memory: {size / GiB:.0f} GiB in {seconds:.1f}s, peak RSS {peak_mib:.0f} MiB")
    finally:
        ctx.stop_agent(agent)
        for leftover in (ctx.ssd / RUN).rglob("*.bin"):
            leftover.unlink()
    settings = agent.settings.get("upload", {})
    label = f"agent, {size / GiB:.0f} GiB checkpoint"
    parts = settings.get("parts_in_flight", 8) * settings.get("part_size_mb", 16)
    return {
        "rows": [
            row("agent idle", "VmRSS", "MiB", [idle["VmRSS"] / 1024], note="before the upload"),
            row(
                label,
                "peak RSS (VmHWM)",
                "MiB",
                [peak["VmHWM"] / 1024],
                note=f"target ≤ {TARGET_MB} MB; part buffers bounded at {parts} MiB",
            ),
            row(label, "throughput", "MB/s", [size / seconds / 1e6]),
        ],
        "notes": ["one sparse file: every byte read, hashed and sent; none stored on disk"],
        "details": {"bytes": size, "seconds": seconds, "idle_kib": idle, "peak_kib": peak},
    }
