"""DCP plugin (tierckpt.client.dcp): bytes each rank reads when a checkpoint
saved by 2 ranks is loaded into 1, 2 and 3 ranks, from the region.

The state is one float32 tensor sharded by rows (DTensor, Shard(0); 96 MiB
with --quick, 384 MiB otherwise) plus two small entries, saved by 2 gloo
ranks with ``TierckptWriter`` (default 8 MiB chunks) and, once durable,
loaded with ``TierckptReader`` from another node's point of view (no T0
copy: every byte from SeaweedFS, every chunk verified). Each rank needs
1/N of the tensor; it reads that, rounded out to chunks, plus the headers
of the stored shards it touches and ``.metadata``. DCP's own reader after a
download (``restore_distributed``) reads the whole checkpoint on every rank
(ratio 1 per rank, N in total). Seconds include starting the ranks' process
group; one measurement each (2 CPUs shared by all ranks, agent and server).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from ..context import BenchContext, log
from ..stats import row

NAME = "dcp_plugin"
TITLE = "DCP plugin: bytes read per rank, 2 ranks saved, N loaded (fraction of the tensor)"
REQUIRES: tuple[str, ...] = ()
RUN = "plugin"
JOB = Path(__file__).resolve().parents[2] / "devsupport" / "dcp_plugin_job.py"
COLS = 1024
MiB = 1024 * 1024


def _job(
    url: str, root: Path, mode: str, world: int, rows: int, *extra: str
) -> list[dict[str, Any]]:
    command = [sys.executable, str(JOB), mode, "--server", url, "--root", str(root)]
    command += ["--world", str(world), "--rows", str(rows), "--cols", str(COLS), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"dcp job {mode} x{world} failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _wait_durable(url: str, step: int) -> None:
    import time

    with httpx.Client(base_url=url, timeout=30) as http:
        while True:
            state = http.get(f"/v1/runs/{RUN}/checkpoints/{step}").json().get("state")
            if state in ("durable", "replicated"):
                return
            if state in ("failed", "deleted"):
                raise RuntimeError(f"{RUN}:{step} ended {state}")
            time.sleep(0.2)


def run(ctx: BenchContext) -> dict[str, Any]:
    rows = (24 if ctx.quick else 96) * 1024  # x 1024 float32 = 96 / 384 MiB
    tensor = rows * COLS * 4
    agent = ctx.start_agent("dcp")
    root = ctx.ssd / "dcp-plugin"  # under the agent's local root: it reads the saved files
    try:
        saved = _job(agent.url, root, "save", 2, rows, "--step", "1")
        _wait_durable(agent.url, 1)
        loads = {
            world: _job(
                agent.url, root / f"load-{world}", "load", world, rows, "--node", "elsewhere"
            )
            for world in (1, 2, 3)
        }
    finally:
        ctx.stop_agent(agent)
        shutil.rmtree(root, ignore_errors=True)
    out = []
    for world, reports in loads.items():
        if not all(r["equal"] for r in reports):
            raise RuntimeError(f"load into {world} ranks gave other values")
        per_rank = [r["bytes_read"] / tensor for r in reports]
        log(f"dcp_plugin: 2 -> {world}: bytes per rank / tensor {[f'{x:.3f}' for x in per_rank]}")
        out.append(
            row(
                f"2 -> {world} rank(s)",
                "bytes read per rank / tensor bytes",
                "ratio",
                per_rank,
                note=f"ideal 1/{world} = {1 / world:.3f}; restore_distributed: 1 per rank",
            )
        )
        out.append(
            row(
                f"2 -> {world} rank(s)",
                "load seconds (slowest rank)",
                "s",
                [max(r["seconds"] for r in reports)],
            )
        )
    out.append(
        row("save, 2 ranks", "save seconds (slowest rank)", "s", [max(r["seconds"] for r in saved)])
    )
    return {
        "rows": out,
        "notes": [
            f"tensor {tensor / MiB:.0f} MiB float32 sharded by rows; 8 MiB chunks, each verified",
            "loads from the region only (another node's view: no T0 copy)",
        ],
        "details": {
            "tensor_bytes": tensor,
            "loads": {str(w): r for w, r in loads.items()},
            "saved": saved,
        },
    }
