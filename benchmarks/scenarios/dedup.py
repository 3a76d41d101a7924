"""Dedup: bytes sent for a checkpoint whose files are 90 % unchanged from the
previous one, and its register → durable time against the full upload.

Each repetition starts a fresh agent with ``[upload] dedup = true`` and its
own empty catalog (the main agent runs with dedup off, see
``benchmarks/context.py``), so its first checkpoint really is new content:

- ``full``: step 1, the benchmark dataset (hard links), all bytes new to
  the region: the pipeline's normal upload;
- ``dedup``: step 2, right after: the large files unchanged (hard links to
  step 1's), every small file rewritten with new random bytes of the same
  size (same name and size: dedup must tell them apart, by its probes), and
  one new file, so that 10 % of step 2's bytes are new.

Bytes sent and copied are the agent's own counters
(``tierckpt_uploaded_bytes_total``, ``tierckpt_dedup_bytes_total`` from its
``/metrics``); step 2's objects are then listed to check that each is a full
object of the right size under step 2's own keys. Times are the catalog's
created_at → durable_at (no polling delay), full and dedup side by side in
the same repetition.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierckpt.client import CheckpointClient
from tierckpt.service.worker_process import REPORT_SECONDS

from ..context import REGION_PREFIX, BenchContext, log, settle
from ..data import link_copy, write_random
from ..stats import MB, ratios, row

NAME = "dedup"
TITLE = "Dedup: checkpoint 90 % unchanged from the previous one vs the full upload"
REQUIRES: tuple[str, ...] = ()

RUN = "bench-dedup"
UNCHANGED_FRACTION = 0.9
TIMEOUT = 900.0
# Quick mode keeps `make bench QUICK=1` short: each repetition starts an
# agent and uploads the dataset once more (~15 s on 2 idle cores), so quick
# mode runs one.
QUICK_REPS = 1
REGION = "bench-east"


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = {"uploaded": 0.0, "dedup": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("region") != REGION:
                continue
            if sample.name == "tierckpt_uploaded_bytes_total":
                found["uploaded"] += sample.value
            elif sample.name == "tierckpt_dedup_bytes_total":
                found["dedup"] += sample.value
    return found


def _settled_counters(url: str) -> dict[str, float]:
    """The counters once the worker process has reported all it did: it
    sends them to the agent every REPORT_SECONDS when they changed, so a read
    right after `durable` may miss the last upload. Two reads that agree two
    report intervals apart are final."""
    last = _counters(url)
    deadline = time.monotonic() + 60
    while True:
        time.sleep(2 * REPORT_SECONDS)
        now = _counters(url)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def _next_checkpoint(ctx: BenchContext, previous: Path, target: Path) -> tuple[int, int]:
    """Step 2 beside step 1: returns (total bytes, new bytes)."""
    large = {relative for relative, _ in ctx.dataset.large}
    changed = 0
    for relative, size in ctx.dataset.files:
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if relative in large:
            os.link(previous / relative, destination)
        else:
            write_random(destination, size)
            changed += size
    total = ctx.dataset.total_bytes
    # (changed + extra) / (total + extra) = 1 - UNCHANGED_FRACTION
    new_share = 1 - UNCHANGED_FRACTION
    extra = max(0, int((new_share * total - changed) / (1 - new_share)))
    if extra:
        write_random(target / "model" / "adapter-new.bin", extra)
    return total + extra, changed + extra


def _timed(client: CheckpointClient, step: int, path: Path) -> float:
    client.register(RUN, step, path)
    detail = client.wait(RUN, step, state="durable", timeout=TIMEOUT)
    if detail.state not in ("durable", "replicated"):
        raise RuntimeError(f"{RUN}:{step} ended {detail.state}")
    assert detail.created_at and detail.durable_at
    return (detail.durable_at - detail.created_at).total_seconds()


def _check_objects(ctx: BenchContext, run: str, step: int, path: Path) -> None:
    prefix = f"{REGION_PREFIX}/{run}/step-{step:012d}/rank-00000/"
    listed: dict[str, int] = {}
    for page in (
        ctx.s3().get_paginator("list_objects_v2").paginate(Bucket=ctx.bucket, Prefix=prefix)
    ):
        for item in page.get("Contents", []):
            listed[item["Key"][len(prefix) :]] = item["Size"]
    local = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    if listed != local:
        raise RuntimeError(f"{run}:{step}: objects {len(listed)} differ from the local files")


def measure(ctx: BenchContext, rep: int) -> dict[str, Any]:
    agent = ctx.start_agent(f"dedup-{rep}", upload={"dedup": True})
    try:
        run_dir = ctx.ssd / RUN / f"rep-{rep}"
        previous = link_copy(ctx.dataset, run_dir / "step-1").root
        total, new = _next_checkpoint(ctx, previous, run_dir / "step-2")
        with CheckpointClient(agent.url) as client:
            before = _settled_counters(agent.url)
            settle()
            full_seconds = _timed(client, 1, previous)
            middle = _settled_counters(agent.url)
            settle()
            began = time.perf_counter()
            dedup_seconds = _timed(client, 2, run_dir / "step-2")
            wall = time.perf_counter() - began
            after = _settled_counters(agent.url)
        _check_objects(ctx, RUN, 2, run_dir / "step-2")
    finally:
        ctx.stop_agent(agent)
    return {
        "full_seconds": full_seconds,
        "dedup_seconds": dedup_seconds,
        "dedup_wall_seconds": wall,
        "full_bytes": ctx.dataset.total_bytes,
        "full_sent": middle["uploaded"] - before["uploaded"],
        "dedup_bytes": total,
        "dedup_new_bytes": new,
        "dedup_sent": after["uploaded"] - middle["uploaded"],
        "dedup_copied": after["dedup"] - middle["dedup"],
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    reps = min(ctx.reps, QUICK_REPS) if ctx.quick else ctx.reps
    results = []
    for rep in range(reps):
        result = measure(ctx, rep)
        results.append(result)
        sent = result["dedup_sent"] / result["dedup_bytes"]
        log(
            f"dedup rep {rep + 1}/{reps}: full {result['full_seconds']:.2f}s, 90%-unchanged "
            f"{result['dedup_seconds']:.2f}s, sent {sent:.1%}"
        )
    sent_pct = [r["dedup_sent"] / r["dedup_bytes"] * 100 for r in results]
    full_pct = [r["full_sent"] / r["full_bytes"] * 100 for r in results]
    copied_pct = [r["dedup_copied"] / r["dedup_bytes"] * 100 for r in results]
    full = [r["full_seconds"] for r in results]
    dedup = [r["dedup_seconds"] for r in results]
    new_pct = results[0]["dedup_new_bytes"] / results[0]["dedup_bytes"] * 100
    extra = results[0]["dedup_bytes"] - ctx.dataset.total_bytes
    rows = [
        row(
            "90 %-unchanged checkpoint",
            "bytes sent / checkpoint bytes",
            "%",
            sent_pct,
            note=f"{new_pct:.1f} % of its bytes are new; target ≤ 15 %",
        ),
        row(
            "90 %-unchanged checkpoint",
            "bytes copied server-side / checkpoint bytes",
            "%",
            copied_pct,
            note="CopyObject into its own keys (plain full objects)",
        ),
        row("full checkpoint", "bytes sent / checkpoint bytes", "%", full_pct),
        row(
            "full checkpoint",
            "register → durable",
            "s",
            full,
            note=f"{ctx.dataset.total_bytes / 1e6:.0f} MB, every byte new (server clock)",
        ),
        row(
            "90 %-unchanged checkpoint",
            "register → durable",
            "s",
            dedup,
            ratio_label="time / full",
            ratio_values=ratios(dedup, full),
            note="hashes the unchanged files locally, sends only the changed ones",
        ),
        row(
            "90 %-unchanged checkpoint",
            "effective throughput",
            "MB/s",
            [r["dedup_bytes"] / r["dedup_seconds"] / MB for r in results],
            ratio_label="/ full",
            ratio_values=ratios(
                [r["dedup_bytes"] / r["dedup_seconds"] for r in results],
                [r["full_bytes"] / r["full_seconds"] for r in results],
            ),
            note="checkpoint bytes / register → durable",
        ),
    ]
    return {
        "rows": rows,
        "notes": [
            f"{reps} repetition(s), each on a fresh agent and catalog (dedup on); full and "
            "90 %-unchanged measured back to back in the same repetition.",
            "Unchanged: the large files (hard links). Changed: every small file rewritten "
            f"with new bytes of the same size, plus {extra / 1e6:.1f} MB in one new file. "
            "Small files (< 1 MiB) are always sent.",
            "Bytes from the agent's counters; step 2's objects listed afterwards: "
            "every file a full object under its own key.",
        ],
        "details": {"runs": results, "dataset": ctx.dataset.describe(), "min_dedup_mib": 1},
    }
