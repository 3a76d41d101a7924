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

from tests.e2e.restore_trainer import mapped_under

pytestmark = [
    pytest.mark.e2e,
    # DCP warns that a load or save without a process group is one process's:
    # what the 1-rank tests mean.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

JOB = Path(__file__).resolve().parents[2] / "devsupport" / "dcp_plugin_job.py"
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

    # The same step saved again (replayed after a resume): the registered
    # files stay as they are, nothing is registered twice, no scratch left.
    files = sorted((ssd / "plugin" / "step-10").rglob("*"))
    stamps = [(p, p.stat().st_mtime_ns) for p in files]
    again = job(agent.url, ssd, "save", 2, "--step", "10")
    assert not any(r["registered"] for r in again)
    assert sorted((ssd / "plugin" / "step-10").rglob("*")) == files
    assert [(p, p.stat().st_mtime_ns) for p in files] == stamps

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
    # chunk that fails its hash comes from the region; the values are right.
    shard = ssd / "plugin" / "step-10" / "rank-00001" / "__1_0.distcp"
    info = shard.stat()
    with open(shard, "r+b") as handle:
        handle.seek(3 * MiB)
        handle.write(b"\xff" * 4096)
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    (one,) = job(agent.url, tmp_path / "r1", "load", 1, "--node", NODE)
    print("2->1 bytes:", one["bytes_read"], one["by_source"])
    assert one["equal"], one
    # Only the chunk that failed (bytes 3 MiB to 3 MiB + 4 KiB) came from the region.
    assert one["by_source"]["local"] >= TENSOR_BYTES and one["by_source"]["east"] == CHUNK, one

    # dcp.async_save through the writer (a process group of its own): each
    # rank registers from DCP's writer thread; the newest step loads.
    saved = job(agent.url, ssd, "save", 2, "--step", "20", "--async-save")
    assert all(r["registered"] for r in saved)
    assert {c["step"]: c["state"] for c in settle(agent.url, "plugin")}[20] == "durable"
    two = job(agent.url, tmp_path / "r2-async", "load", 2, "--node", "elsewhere")
    assert all(r["equal"] and r["step"] == 20 for r in two), two


def _load_one_rank(url: str, root: Path, node: str) -> tuple[Any, dict[str, Any]]:
    """A 1-rank load in this process (no process group); (reader, state)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt.client import CheckpointClient
    from tierckpt.client.dcp import TierckptReader

    state: dict[str, Any] = {"w": torch.zeros(ROWS // 8, COLS), "b": torch.zeros(8)}
    with CheckpointClient(url, timeout=60) as client:
        reader = TierckptReader(client, "plugin", root, node=node)
        dcp.load(state, storage_reader=reader)
    assert mapped_under([str(root)]) == []  # the loaded tensors are this process's own
    return reader, state


def test_one_rank_fallbacks_and_refusals(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    s3_client: Any,
    s3_bucket: str,
) -> None:
    """One rank, in this process: a checkpoint without chunk hashes (uploaded
    before they existed) is verified whole, from T0 or the region; a file
    whose every copy is wrong is refused, not loaded."""
    import sqlite3

    import torch
    import torch.distributed.checkpoint as dcp

    from tierckpt.client import CheckpointClient
    from tierckpt.client.dcp import TierckptWriter
    from tierckpt.client.errors import RestoreError

    agent, ssd = start_agent(upload={"chunk_size_mb": 1})
    saved = {"w": torch.randn(ROWS // 8, COLS), "b": torch.arange(8.0)}
    with CheckpointClient(agent.url, timeout=60) as client:
        writer = TierckptWriter(client, "plugin", 3, ssd)
        dcp.save(saved, storage_writer=writer)
    assert writer.checkpoint is not None and writer.checkpoint.world_size == 1
    (checkpoint,) = settle(agent.url, "plugin")
    assert checkpoint["state"] == "durable"

    reader, state = _load_one_rank(agent.url, tmp_path / "chunked", "elsewhere")
    assert torch.equal(state["w"], saved["w"]) and torch.equal(state["b"], saved["b"])
    assert set(reader.bytes_by_source) == {"east"}

    # As if uploaded before chunk hashes: whole files, verified whole.
    with sqlite3.connect(tmp_path / "catalog.db") as catalog:
        catalog.execute("UPDATE files SET chunk_size = NULL, chunk_sha256 = NULL")
    with CheckpointClient(agent.url) as client:
        detail = client.get("plugin", 3)
    whole = sum(f.size for f in detail.files)
    for node, source in (("elsewhere", "east"), (NODE, "local")):
        reader, state = _load_one_rank(agent.url, tmp_path / f"whole-{source}", node)
        assert torch.equal(state["w"], saved["w"]), source
        assert reader.bytes_by_source == {source: whole}, (source, reader.bytes_by_source)
    assert not list((tmp_path / "whole-east" / "plugin").glob("*")), "scratch left behind"

    # Every copy wrong (T0 changed with its mtime kept; the region's object
    # overwritten): refused.
    shard = ssd / "plugin" / "step-3" / "rank-00000" / "__0_0.distcp"
    info = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    s3_client.put_object(
        Bucket=s3_bucket, Key="torch/plugin/step-000000000003/rank-00000/__0_0.distcp", Body=data
    )
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as refused:
        _load_one_rank(agent.url, tmp_path / "bad", NODE)
    ((failure, _traceback),) = refused.value.failures.values()
    assert isinstance(failure, RestoreError) and "verifies" in str(failure), failure
