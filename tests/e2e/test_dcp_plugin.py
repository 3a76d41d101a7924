"""End to end: tierckpt.client.dcp's TierckptWriter / TierckptReader with
real torch.distributed (gloo, CPU, spawned ranks), the real agent and
SeaweedFS, 1 MiB chunks.

A 12 MiB row-sharded tensor saved by 2 ranks loads into 3 ranks, 2 ranks and
1 rank, equal to what was saved; with 3 ranks each reads about a third of
the tensor bytes (the slice it needs, rounded out to chunks, plus the
archive's header and directory), not every stored shard its slice touches.
Loads read this node's T0 copies when the agent calls them intact, the
region otherwise, and a T0 chunk that does not match its hash (the file
changed behind the agent's back, size and mtime kept) is read again from
the region.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_torch_resume import NODE, AgentFactory, settle, start_agent  # noqa: F401

pytest.importorskip("torch")

pytestmark = pytest.mark.e2e

JOB = Path(__file__).with_name("dcp_plugin_job.py")
MiB = 1024 * 1024
ROWS, COLS = 3072, 1024  # 12 MiB of float32
TENSOR_BYTES = ROWS * COLS * 4
CHUNK = 1 * MiB


def job(url: str, root: Path, mode: str, world: int, *extra: str) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        str(JOB),
        mode,
        "--server",
        url,
        "--root",
        str(root),
        "--world",
        str(world),
        "--rows",
        str(ROWS),
        "--cols",
        str(COLS),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == list(range(world)), done.stdout
    return sorted(reports, key=lambda r: r["rank"])


def test_save_two_ranks_load_into_three_two_and_one(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
) -> None:
    agent, ssd = start_agent(upload={"chunk_size_mb": 1})
    saved = job(agent.url, ssd, "save", 2, "--step", "10")
    assert all(r["registered"] for r in saved)
    (checkpoint,) = settle(agent.url, "plugin")
    assert checkpoint["state"] == "durable" and checkpoint["world_size"] == 2

    # 2 -> 3 from the region (another node: no T0 copy to read).
    three = job(agent.url, tmp_path / "r3", "load", 3, "--node", "elsewhere")
    print("2->3 bytes per rank:", [r["bytes_read"] for r in three])
    for r in three:
        assert r["equal"] and r["step"] == 10, r
        assert set(r["by_source"]) == {"east"}, r
        # Its third of the tensor, plus at most: chunk rounding at both ends
        # of each stored shard it touches, those shards' headers and
        # directories, and .metadata (one chunk).
        assert TENSOR_BYTES / 3 <= r["bytes_read"] <= TENSOR_BYTES / 3 + 7 * CHUNK, r
    assert sum(r["bytes_read"] for r in three) < 1.6 * TENSOR_BYTES

    # 2 -> 2 from this node's T0 copies: nothing from the region.
    two = job(agent.url, tmp_path / "r2", "load", 2, "--node", NODE)
    print("2->2 bytes per rank:", [r["bytes_read"] for r in two])
    for r in two:
        assert r["equal"] and set(r["by_source"]) == {"local"}, r
        assert r["bytes_read"] <= TENSOR_BYTES / 2 + 3 * CHUNK, r

    # A T0 copy changed behind the agent's back (size and mtime kept): the
    # chunks that fail their hash come from the region; the values are right.
    shard = ssd / "plugin" / "step-10" / "rank-00001" / "__1_0.distcp"
    info = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(3 * MiB)
        handle.write(b"\xff" * 4096)
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    (one,) = job(agent.url, tmp_path / "r1", "load", 1, "--node", NODE)
    print("2->1 bytes:", one["bytes_read"], one["by_source"])
    assert one["equal"], one
    assert one["by_source"]["local"] > 0 and one["by_source"]["east"] >= CHUNK, one
