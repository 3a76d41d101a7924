"""Restore of an N-rank sharded DCP state (N = 2 and 4, gloo, CPU): what each
rank reads and how long its load takes, four ways.

The state is one float32 tensor sharded by rows (DTensor, Shard(0); 32 MiB
with --quick, 256 MiB otherwise) plus two small entries, saved by N ranks
with ``TierckptWriter`` and, once durable, loaded back into N ranks:

- ``TierckptReader``, region: another node's view (no T0 copy), every byte
  from SeaweedFS, each range verified by its chunks' SHA-256 (8 MiB chunks);
- ``TierckptReader``, local: this node's T0 copies (the saving node, or one
  the checkpoint was prefetched to), chunks verified as read;
- the restore before the plugin, ``restore_distributed``: every rank
  downloads the whole checkpoint (verified) from the region, then DCP's
  ``FileSystemReader`` reads its part;
- plain DCP ``FileSystemReader`` on an already-local flat copy: no
  verification, its reads counted by the kernel (``rchar`` around the load).

Bytes are per rank as a fraction of the checkpoint's bytes; seconds are each
rank's load alone (process group already up), one measurement per rank on 2
CPUs shared by all ranks, the agent and SeaweedFS: indicative.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx

from ..context import BenchContext, log
from ..stats import row
from .dcp_plugin import COLS, RUN, MiB, _job, _wait_durable

NAME = "dcp_restore"
TITLE = "DCP restore, N ranks saved and loaded: bytes and seconds per rank (4 ways)"
REQUIRES: tuple[str, ...] = ()
WORLDS = (2, 4)
NODE = "bench-node"  # the bench agents' [server] node (benchmarks/context.py)
MODES = {
    # name: (job mode, node asked, what it is)
    "reader-region": ("load", "elsewhere", "TierckptReader from the region"),
    "reader-local": ("load", NODE, "TierckptReader from this node's T0"),
    "whole": ("load-whole", "elsewhere", "every rank restores the whole checkpoint"),
    "fs-local": ("load-fs", None, "plain DCP FileSystemReader, local copy"),
}


def _checkpoint_bytes(url: str, step: int) -> int:
    with httpx.Client(base_url=url, timeout=30) as http:
        detail = http.get(f"/v1/runs/{RUN}/checkpoints/{step}").json()
    return int(sum(f["size"] for f in detail["files"]))


def _flat_copy(url: str, step: int, dest: Path) -> Path:
    """A plain local copy for FileSystemReader (restored, verified, flat)."""
    from tierckpt.client import CheckpointClient

    with CheckpointClient(url, timeout=120) as client:
        return client.restore(RUN, dest, step=step)


def run(ctx: BenchContext) -> dict[str, Any]:
    rows_total = (8 if ctx.quick else 64) * 1024  # x 1024 float32 = 32 / 256 MiB
    tensor = rows_total * COLS * 4
    agent = ctx.start_agent("dcpr")
    root = ctx.ssd / "dcp-restore"
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    sizes: dict[int, int] = {}
    try:
        for world in WORLDS:
            step = world
            _job(agent.url, root, "save", world, rows_total, "--step", str(step))
            _wait_durable(agent.url, step)
            sizes[world] = _checkpoint_bytes(agent.url, step)
            flat = _flat_copy(agent.url, step, root / f"flat-{world}")
            results[world] = {}
            for name, (mode, node, _what) in MODES.items():
                extra = ["--step", str(step)]
                extra += ["--node", node] if node else ["--local", str(flat)]
                reports = _job(agent.url, root / f"{name}-{world}", mode, world, rows_total, *extra)
                if not all(r["equal"] for r in reports):
                    raise RuntimeError(f"{name} x{world} loaded other values")
                results[world][name] = sorted(reports, key=lambda r: r["rank"])
                log(
                    f"dcp_restore: N={world} {name}: bytes/rank "
                    f"{[r['bytes_read'] for r in reports]} seconds "
                    f"{[round(r['load_seconds'], 3) for r in reports]}"
                )
    finally:
        ctx.stop_agent(agent)
        shutil.rmtree(root, ignore_errors=True)
    return _rows(results, sizes, tensor)


def _rows(
    results: dict[int, dict[str, list[dict[str, Any]]]], sizes: dict[int, int], tensor: int
) -> dict[str, Any]:
    out = []
    for world, modes in results.items():
        whole = modes["whole"]
        fs = modes["fs-local"]
        for name, reports in modes.items():
            what = MODES[name][2]
            fractions = [r["bytes_read"] / sizes[world] for r in reports]
            out.append(
                row(
                    f"N={world}: {what}",
                    "bytes read per rank / checkpoint bytes",
                    "ratio",
                    fractions,
                    ratio_label="vs every rank restoring the whole checkpoint",
                    ratio_values=[
                        r["bytes_read"] / w["bytes_read"]
                        for r, w in zip(reports, whole, strict=True)
                    ],
                    note=f"ideal 1/{world} = {1 / world:.3f}",
                )
            )
            out.append(
                row(
                    f"N={world}: {what}",
                    "load seconds per rank",
                    "s",
                    [r["load_seconds"] for r in reports],
                    ratio_label="vs plain FileSystemReader on a local copy",
                    ratio_values=[
                        r["load_seconds"] / f["load_seconds"]
                        for r, f in zip(reports, fs, strict=True)
                    ],
                    note=(
                        "x vs whole-checkpoint restore: "
                        + ", ".join(
                            f"{r['load_seconds'] / w['load_seconds']:.2f}"
                            for r, w in zip(reports, whole, strict=True)
                        )
                    ),
                )
            )
    return {
        "rows": out,
        "notes": [
            f"tensor {tensor / MiB:.0f} MiB float32 sharded by rows over N gloo ranks, saved "
            "and loaded by N; 8 MiB chunks",
            "seconds: each rank's load alone, one measurement per rank (2 shared CPUs)",
        ],
        "details": {
            "tensor_bytes": tensor,
            "checkpoint_bytes": {str(w): b for w, b in sizes.items()},
            "loads": {str(w): m for w, m in results.items()},
        },
    }
