"""Register latency: the trainer's stall, for a 1 MB and a 10 GiB checkpoint.

Register only lists the files (size, mtime) and writes catalog rows; it never
reads content, so its latency must not depend on the checkpoint's size. The
large checkpoint is a sparse 10 GiB file (``truncate``): no disk is used.

This runs on a second agent started with ``TIERCKPT_WORKER__ENABLED=false``
and its own SQLite catalog (same region, same local root): nothing is ever
uploaded, so the 10 GiB file does not swamp the machine and no upload
competes with the registrations being timed. The registrations alternate
small / large (which goes first alternates too), ``N`` each per round, after
a short warm-up; every round gives one p50 and one p99 per size, and the
large/small ratio is taken within the round.
"""

from __future__ import annotations

import time
from typing import Any

from tierckpt.client import CheckpointClient

from ..context import BenchContext, log
from ..data import MiB, sparse_file, write_random
from ..stats import percentile, ratios, row

NAME = "register_latency"
TITLE = "Register latency (trainer stall, ms; lower is better)"
REQUIRES: tuple[str, ...] = ()

LARGE_BYTES = 10 * 1024 * MiB
SMALL_BYTES = 1 * MiB
WARMUP = 5


def run(ctx: BenchContext) -> dict[str, Any]:
    count = 50 if ctx.quick else 200
    base = ctx.ssd / "latency"
    small = base / "small"
    large = base / "large"
    write_random(small / "model.bin", SMALL_BYTES)
    sparse_file(large / "model.bin", LARGE_BYTES)
    allocated = (large / "model.bin").stat().st_blocks * 512

    agent = ctx.start_agent("latency", worker=False)
    try:
        with CheckpointClient(agent.url) as client:
            sources = {
                "small": ("bench-latency-small", small),
                "large": ("bench-latency-large", large),
            }
            last_step = {"small": 0, "large": 0}

            def register(kind: str) -> float:
                run_name, path = sources[kind]
                last_step[kind] += 1
                step = last_step[kind]
                began = time.perf_counter()
                answer = client.register(run_name, step, path)
                elapsed = time.perf_counter() - began
                if answer.state != "registered":
                    raise RuntimeError(f"register {run_name}:{step} answered {answer.state}")
                return elapsed * 1000

            for _ in range(WARMUP):
                register("small")
                register("large")
            rounds: list[dict[str, list[float]]] = []
            for number in range(ctx.reps):
                samples: dict[str, list[float]] = {"small": [], "large": []}
                for i in range(count):
                    order = ("small", "large") if i % 2 == 0 else ("large", "small")
                    for kind in order:
                        samples[kind].append(register(kind))
                rounds.append(samples)
                log(
                    f"register round {number + 1}/{ctx.reps}: p50 small "
                    f"{percentile(samples['small'], 50):.1f} ms, large "
                    f"{percentile(samples['large'], 50):.1f} ms"
                )
            detail = client.get("bench-latency-large", last_step["large"])
    finally:
        ctx.stop_agent(agent)

    rows: list[dict[str, Any]] = []
    for pct in (50, 99):
        by_size = {
            kind: [percentile(samples[kind], pct) for samples in rounds]
            for kind in ("small", "large")
        }
        rows.append(row("1 MiB checkpoint", f"p{pct}", "ms", by_size["small"]))
        rows.append(
            row(
                "10 GiB checkpoint (sparse)",
                f"p{pct}",
                "ms",
                by_size["large"],
                ratio_label="large / small",
                ratio_values=ratios(by_size["large"], by_size["small"]),
                note="10240× the bytes",
            )
        )
    maxima = {kind: [max(samples[kind]) for samples in rounds] for kind in ("small", "large")}
    rows.append(row("1 MiB checkpoint", "max", "ms", maxima["small"]))
    rows.append(
        row(
            "10 GiB checkpoint (sparse)",
            "max",
            "ms",
            maxima["large"],
            ratio_label="large / small",
            ratio_values=ratios(maxima["large"], maxima["small"]),
        )
    )
    return {
        "rows": rows,
        "notes": [
            f"{count} registrations per size per round, {ctx.reps} rounds, after {WARMUP} "
            "warm-up each; sync CheckpointClient.register over keep-alive HTTP, SQLite catalog.",
            "Separate agent with TIERCKPT_WORKER__ENABLED=false: nothing uploads during the "
            f"test (the sparse file has {allocated} bytes allocated on disk).",
            "Sequential client: each registration is a group-commit batch of its own, so this "
            "is one catalog transaction including its fsync (SQLite synchronous=FULL).",
        ],
        "details": {
            "registrations_per_round": count,
            "rounds": rounds,
            "large_bytes": LARGE_BYTES,
            "large_allocated_bytes": allocated,
            "small_bytes": SMALL_BYTES,
            "large_total_bytes_in_catalog": detail.total_bytes,
        },
    }
