"""CPU cost per GB uploaded and the agent's memory, from the upload scenario's runs.

- tierckpt: CPU seconds (user + system, /proc/<pid>/stat) of the agent
  and its worker process (which uploads) during register → durable, per GB.
- boto3: CPU seconds of this benchmark process (all its threads) during the
  uploads, per GB: there is no other work in it meanwhile.
- SeaweedFS: CPU of the `weed` process during each variant, per GB; the
  server does the same work for every variant, so this is a sanity check.
- Memory: the VmRSS of the agent and its worker process before the first
  upload and their VmHWM (peak resident set, summed) after the last one; bounded by design by
  ``upload.parts_in_flight × upload.part_size_mb``.
"""

from __future__ import annotations

from typing import Any

from ..context import BenchContext
from ..stats import GB, ratios, row

NAME = "cpu"
TITLE = "CPU seconds per GB uploaded (lower is better) and agent memory"
REQUIRES: tuple[str, ...] = ("upload",)

PART_SIZE_MB_DEFAULT = 16
PARTS_IN_FLIGHT_DEFAULT = 8


def run(ctx: BenchContext) -> dict[str, Any]:
    upload = ctx.shared["upload"]
    results = upload["results"]
    gigabytes = upload["bytes"] / GB
    names: list[str] = upload["names"]

    def per_gb(name: str, key: str) -> list[float]:
        return [r[key] / gigabytes for r in results[name]]

    per_poll = upload["agent_cpu_per_poll_s"]
    tier = per_gb("tierckpt", "cpu_agent")
    tier_net = [(r["cpu_agent"] - r["polls"] * per_poll) / gigabytes for r in results["tierckpt"]]
    rows = [
        row(
            "tierckpt agent",
            "CPU",
            "s/GB",
            tier,
            note="upload + SHA-256 + catalog + manifest + serving the polls",
        ),
        row(
            "tierckpt agent − polls",
            "CPU",
            "s/GB",
            tier_net,
            note="minus polls × measured CPU per poll",
        ),
    ]
    for name in names[1:]:
        mine = per_gb(name, "cpu_bench")
        rows.append(
            row(
                name,
                "CPU",
                "s/GB",
                mine,
                ratio_label="tierckpt / this",
                ratio_values=ratios(tier, mine),
                note="the benchmark process (boto3 threads)",
            )
        )
    for name in names:
        rows.append(
            row(
                f"SeaweedFS during {name}",
                "CPU",
                "s/GB",
                per_gb(name, "cpu_seaweed"),
                ratio_label="this / during tierckpt",
                ratio_values=ratios(per_gb(name, "cpu_seaweed"), per_gb("tierckpt", "cpu_seaweed")),
                note="server side, same work for every variant",
            )
        )
    idle = upload["memory_idle_kib"]["VmRSS"] / 1024
    peak = upload["memory_after_kib"]["VmHWM"] / 1024
    upload_settings = ctx.agent.settings.get("upload", {})
    bound = upload_settings.get("parts_in_flight", PARTS_IN_FLIGHT_DEFAULT) * upload_settings.get(
        "part_size_mb", PART_SIZE_MB_DEFAULT
    )
    rows.append(row("tierckpt agent", "RSS before uploads", "MiB", [idle], note="VmRSS, n=1"))
    after_each = [r["agent_memory_kib"]["VmRSS"] / 1024 for r in results["tierckpt"]]
    rows.append(
        row(
            "tierckpt agent",
            "RSS after each upload",
            "MiB",
            after_each,
            ratio_label="last / first",
            ratio_values=[after_each[-1] / after_each[0]],
            note="VmRSS once durable; growth across repetitions would be a leak",
        )
    )
    rows.append(
        row(
            "tierckpt agent",
            "peak RSS after uploads",
            "MiB",
            [peak],
            ratio_label="peak / idle",
            ratio_values=[peak / idle],
            note=f"VmHWM, n=1 (high-water mark); part buffers bounded at {bound} MiB",
        )
    )
    return {
        "rows": rows,
        "notes": [
            "Agent CPU is the `tierckpt serve` process (/proc/<pid>/stat utime+stime); boto3 "
            "CPU is this benchmark process, which does nothing else meanwhile.",
        ],
        "details": {
            "agent_memory_idle_kib": upload["memory_idle_kib"],
            "agent_memory_after_kib": upload["memory_after_kib"],
            "part_buffer_bound_mib": bound,
        },
    }
