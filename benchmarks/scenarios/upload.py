"""Upload: tierckpt register → durable against boto3 `upload_file`, same files, same server.

Variants, each repeated ``ctx.reps`` times in a rotating order (so drift on a
shared machine hits them all alike), each time to a fresh step / key prefix:

- ``tierckpt``: one POST /v1/checkpoints, then GET every 250 ms until
  ``durable``. Timed as the POST's round trip plus the catalog's own
  created_at → durable_at (which the POST's round trip overlaps, so the sum
  slightly over-counts). Polling is sparse on purpose: every poll costs the
  agent CPU on the same 2 cores it uploads with (measured and reported), and
  a 50 Hz poll, as in the first version of this benchmark, took ~10% of the
  machine from the upload it was timing. The client-seen time (first poll
  that says ``durable``, up to 250 ms late) is kept as a second row.
- ``boto3 default``: ``upload_file`` per file, one file after another (what a
  user script does), default TransferConfig (8 MiB parts, 10 threads).
- ``boto3 tuned``: the same with 16 MiB parts and 16 threads.
- ``boto3 pool×8``: 8 files at a time from a ThreadPoolExecutor (as many as
  the agent's ``upload.files_in_flight``), default TransferConfig; the client
  gets ``max_pool_connections=64`` so the threads do not fight over sockets.

With ``--quick`` only ``tierckpt`` and ``boto3 default`` (the target's
baseline) run.

The boto3 client is ``devsupport.seaweed.boto3_client`` (CRC checksums
only when required), as a user of a third-party store configures it.
The CPU figures measured here are reported by the ``cpu`` scenario.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from boto3.s3.transfer import TransferConfig

from tierckpt.client import CheckpointClient

from ..context import BASELINE_PREFIX, BenchContext, log, settle
from ..data import Dataset, MiB, link_copy, write_random
from ..procstat import cpu_seconds, self_cpu_seconds, tree_cpu_seconds, tree_memory_kib
from ..stats import MB, compared_rows, percentile, ratios, row

NAME = "upload"
TITLE = "Upload: tierckpt register → durable vs boto3 upload_file (MB/s, higher is better)"
REQUIRES: tuple[str, ...] = ()

RUN = "bench-upload"
TINY_RUN = "bench-tiny"
TINY_BYTES = 4096
TINY_PER_REP = 8
POLL_SECONDS = 0.25
DURABLE_TIMEOUT = 900.0
POOL_FILES = 8
TUNED = {"multipart_chunksize": 16 * MiB, "max_concurrency": 16}
FAILED = ("failed", "corrupt", "deleted")

Measure = Callable[[BenchContext, int], dict[str, Any]]


def _durable_poll(
    http: httpx.Client, step: int, deadline: float, run: str = RUN, every: float = POLL_SECONDS
) -> int:
    """Poll the step's list entry until durable; returns the number of polls."""
    polls = 0
    params = {"min_step": step, "max_step": step, "limit": 1}
    while True:
        answer = http.get(f"/v1/runs/{run}/checkpoints", params=params)
        answer.raise_for_status()
        polls += 1
        state = answer.json()["checkpoints"][0]["state"]
        if state in ("durable", "replicated"):
            return polls
        if state in FAILED:
            raise RuntimeError(f"checkpoint {run}:{step} ended {state}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {run}:{step} still {state} after {DURABLE_TIMEOUT}s")
        time.sleep(every)


def _cpu_marks(ctx: BenchContext) -> dict[str, float]:
    return {
        "agent": tree_cpu_seconds(ctx.agent.pid),
        "seaweed": cpu_seconds(ctx.seaweed.pid or 0),
        "bench": self_cpu_seconds(),
    }


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {f"cpu_{k}": after[k] - before[k] for k in before}


def measure_tierckpt(ctx: BenchContext, rep: int) -> dict[str, Any]:
    step = ctx.next_step()
    dataset = link_copy(ctx.dataset, ctx.ssd / RUN / f"step-{step}")
    with (
        CheckpointClient(ctx.agent.url) as client,
        httpx.Client(base_url=ctx.agent.url, timeout=30) as http,
    ):
        before = _cpu_marks(ctx)
        began = time.perf_counter()
        client.register(RUN, step, dataset.root)
        register_seconds = time.perf_counter() - began
        polls = _durable_poll(http, step, time.monotonic() + DURABLE_TIMEOUT)
        client_seconds = time.perf_counter() - began
        after = _cpu_marks(ctx)
        detail = client.get(RUN, step)
    if detail.total_bytes != ctx.dataset.total_bytes or len(detail.files) != len(dataset.files):
        raise RuntimeError(f"{RUN}:{step}: catalog disagrees with the dataset: {detail}")
    if not (detail.created_at and detail.durable_at):
        raise RuntimeError(f"{RUN}:{step}: durable without created_at/durable_at: {detail}")
    server_seconds = (detail.durable_at - detail.created_at).total_seconds()
    steps = ctx.shared.setdefault("upload_steps", [])
    steps.append(step)
    return {
        "seconds": register_seconds + server_seconds,
        "client_seconds": client_seconds,
        "register_seconds": register_seconds,
        "server_seconds": server_seconds,
        "polls": polls,
        "step": step,
        "agent_memory_kib": tree_memory_kib(ctx.agent.pid),
        **_cpu_delta(before, after),
    }


def _boto3_measure(client: Any, config: TransferConfig, variant: str, pool: int | None) -> Measure:
    def measure(ctx: BenchContext, rep: int) -> dict[str, Any]:
        prefix = f"{BASELINE_PREFIX}/{variant}/rep-{rep}"
        dataset: Dataset = ctx.dataset

        def put(item: tuple[str, int]) -> None:
            relative, _ = item
            client.upload_file(
                str(dataset.root / relative), ctx.bucket, f"{prefix}/{relative}", Config=config
            )

        before = _cpu_marks(ctx)
        began = time.perf_counter()
        if pool is None:
            for item in dataset.files:
                put(item)
        else:
            with ThreadPoolExecutor(max_workers=pool) as executor:
                list(executor.map(put, dataset.files))
        seconds = time.perf_counter() - began
        after = _cpu_marks(ctx)
        _check_uploaded(client, ctx, prefix)
        return {"seconds": seconds, "prefix": prefix, **_cpu_delta(before, after)}

    return measure


def _check_uploaded(client: Any, ctx: BenchContext, prefix: str) -> None:
    total = count = 0
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=ctx.bucket, Prefix=f"{prefix}/"
    ):
        for item in page.get("Contents", []):
            total += item["Size"]
            count += 1
    if (count, total) != (len(ctx.dataset.files), ctx.dataset.total_bytes):
        raise RuntimeError(f"boto3 upload to {prefix}: {count} objects, {total} bytes")


def variants(ctx: BenchContext) -> dict[str, Measure]:
    """What is timed; with --quick only what the target is measured against
    (boto3's defaults), so quick mode stays short."""
    plain = ctx.s3()
    measures = {
        "tierckpt": measure_tierckpt,
        "boto3 default": _boto3_measure(plain, TransferConfig(), "default", None),
    }
    if not ctx.quick:
        pooled = ctx.s3(max_pool_connections=64)
        measures["boto3 tuned"] = _boto3_measure(plain, TransferConfig(**TUNED), "tuned", None)
        measures[f"boto3 pool×{POOL_FILES}"] = _boto3_measure(
            pooled, TransferConfig(), f"pool{POOL_FILES}", POOL_FILES
        )
    return measures


def poll_cost(ctx: BenchContext, step: int, count: int = 100) -> dict[str, float]:
    """Agent CPU seconds per status request, measured on a durable checkpoint:
    the list entry this benchmark polls, and the full detail (with its file
    list) that CheckpointClient.wait polls."""
    paths = {
        "list_entry": (f"/v1/runs/{RUN}/checkpoints", {"min_step": step, "max_step": step}),
        "detail": (f"/v1/runs/{RUN}/checkpoints/{step}", {}),
    }
    costs: dict[str, float] = {}
    with httpx.Client(base_url=ctx.agent.url, timeout=30) as http:
        for name, (path, params) in paths.items():
            http.get(path, params=params).raise_for_status()
            before = cpu_seconds(ctx.agent.pid)
            for _ in range(count):
                http.get(path, params=params).raise_for_status()
            costs[name] = (cpu_seconds(ctx.agent.pid) - before) / count
    return costs


def fixed_cost(ctx: BenchContext) -> dict[str, list[list[float]]]:
    """Register → durable of a one-file 4 KiB checkpoint against boto3
    ``upload_file`` of that file, in ms: the per-checkpoint overhead (job
    claim, catalog transactions, manifest) that no bandwidth hides.
    ``TINY_PER_REP`` of each per repetition, alternating, after one warm-up;
    polled every 5 ms, and the catalog's created_at → durable_at kept too."""
    s3 = ctx.s3()
    out: dict[str, list[list[float]]] = {"tierckpt": [], "tierckpt_server": [], "boto3": []}
    with (
        CheckpointClient(ctx.agent.url) as client,
        httpx.Client(base_url=ctx.agent.url, timeout=30) as http,
    ):

        def one() -> tuple[float, float | None, float]:
            step = ctx.next_step()
            directory = ctx.ssd / TINY_RUN / f"step-{step}"
            write_random(directory / "config.json", TINY_BYTES)
            began = time.perf_counter()
            client.register(TINY_RUN, step, directory)
            _durable_poll(http, step, time.monotonic() + 60, run=TINY_RUN, every=0.005)
            tier = (time.perf_counter() - began) * 1000
            detail = client.get(TINY_RUN, step)
            server = None
            if detail.created_at and detail.durable_at:
                server = (detail.durable_at - detail.created_at).total_seconds() * 1000
            key = f"{BASELINE_PREFIX}/tiny/{step}/config.json"
            began = time.perf_counter()
            s3.upload_file(str(directory / "config.json"), ctx.bucket, key)
            return tier, server, (time.perf_counter() - began) * 1000

        one()  # warm-up
        for _ in range(ctx.reps):
            samples = [one() for _ in range(TINY_PER_REP)]
            out["tierckpt"].append([t for t, _, _ in samples])
            out["tierckpt_server"].append([s for _, s, _ in samples if s is not None])
            out["boto3"].append([b for _, _, b in samples])
    return out


def _tiny_rows(tiny: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    boto_p50 = [percentile(rep, 50) for rep in tiny["boto3"]]
    boto_max = [max(rep) for rep in tiny["boto3"]]
    for key, label, note in (
        ("tierckpt", "tierckpt, 4 KiB checkpoint", "fixed cost per checkpoint (polled every 5 ms)"),
        ("tierckpt_server", "tierckpt, 4 KiB (server clock)", "created_at → durable_at"),
    ):
        if any(not rep for rep in tiny[key]):
            continue
        p50 = [percentile(rep, 50) for rep in tiny[key]]
        worst = [max(rep) for rep in tiny[key]]
        rows.append(
            row(
                label,
                "register → durable p50",
                "ms",
                p50,
                ratio_label="tierckpt time / boto3",
                ratio_values=ratios(p50, boto_p50),
                note=note,
            )
        )
        rows.append(
            row(
                label,
                f"register → durable max of {TINY_PER_REP}",
                "ms",
                worst,
                ratio_label="tierckpt time / boto3",
                ratio_values=ratios(worst, boto_max),
                note=note,
            )
        )
    rows.append(row("boto3, 4 KiB file", "upload_file p50", "ms", boto_p50, note="one PUT"))
    return rows


def run(ctx: BenchContext) -> dict[str, Any]:
    measures = variants(ctx)
    names = list(measures)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    memory_idle = tree_memory_kib(ctx.agent.pid)
    for rep in range(ctx.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            settle()
            result = measures[name](ctx, rep)
            results[name].append(result)
            mbps = ctx.dataset.total_bytes / result["seconds"] / MB
            log(f"upload rep {rep + 1}/{ctx.reps} {name:<16} {mbps:7.1f} MB/s")
    memory_peak = tree_memory_kib(ctx.agent.pid)
    costs = poll_cost(ctx, results["tierckpt"][-1]["step"])
    tiny = fixed_cost(ctx)
    per_poll = costs["list_entry"]

    size = ctx.dataset.total_bytes
    mbps = {name: [size / r["seconds"] / MB for r in results[name]] for name in names}
    rows = compared_rows(
        "throughput",
        "MB/s",
        mbps,
        {
            "tierckpt": "register round trip + catalog created_at → durable_at; + SHA-256 of "
            "every file, MANIFEST.json, catalog rows"
        },
        default_note="no content hash kept, no manifest, no catalog",
    )
    client_seen = [size / r["client_seconds"] / MB for r in results["tierckpt"]]
    rows.append(
        row(
            "tierckpt (client-seen)",
            "throughput",
            "MB/s",
            client_seen,
            ratio_label="client-seen / headline",
            ratio_values=ratios(client_seen, mbps["tierckpt"]),
            note=f"first poll that says durable (polls every {POLL_SECONDS * 1000:.0f} ms)",
        )
    )
    rows.extend(_tiny_rows(tiny))
    ctx.shared["upload"] = {
        "results": results,
        "bytes": size,
        "memory_idle_kib": memory_idle,
        "memory_after_kib": memory_peak,
        "agent_cpu_per_poll_s": per_poll,
        "names": names,
    }
    polls = [r["polls"] for r in results["tierckpt"]]
    tiny_all = [ms for rep in tiny["tierckpt_server"] for ms in rep]
    poll_interval = ctx.agent.settings.get("worker", {}).get("poll_interval", 0.5)
    slow = sum(ms > poll_interval * 1000 * 0.8 for ms in tiny_all)
    return {
        "rows": rows,
        "notes": [
            f"{len(ctx.dataset.files)} files, {size / 1e6:.0f} MB of random bytes; each variant "
            f"{ctx.reps}× in rotating order; ratios are paired per repetition.",
            "Over plain HTTP boto3 SHA-256-hashes every request body for SigV4 (and keeps "
            "nothing); the agent signs UNSIGNED-PAYLOAD and computes the SHA-256 it records.",
            f"tierckpt is timed by polling every {POLL_SECONDS * 1000:.0f} ms; the polls cost "
            f"the agent {per_poll * 1000:.2f} ms CPU each ({sum(polls) / len(polls):.0f} "
            "polls per upload on average); the step's list entry is polled, not its detail "
            f"with {len(ctx.dataset.files)} files, which costs {costs['detail'] * 1000:.2f} ms.",
            f"4 KiB checkpoints: {slow} of {len(tiny_all)} took over "
            f"{poll_interval * 800:.0f} ms (server clock); the worker's poll_interval is "
            f"{poll_interval:g} s.",
        ],
        "details": {
            "bytes": size,
            "files": len(ctx.dataset.files),
            "dataset": ctx.dataset.describe(),
            "runs": results,
            "transfer_configs": {
                "boto3 default": "TransferConfig()",
                "boto3 tuned": f"TransferConfig(**{TUNED})",
                f"boto3 pool×{POOL_FILES}": f"ThreadPoolExecutor({POOL_FILES}) × TransferConfig(),"
                " max_pool_connections=64",
            },
            "agent_cpu_per_request_s": costs,
            "tiny_checkpoint_ms": tiny,
        },
    }
