"""Benchmark scenarios, one module each, run in this order.

A scenario module has:
- ``NAME`` (the key in the JSON and for ``--only``), ``TITLE`` (table title);
- ``REQUIRES``: names of scenarios that must run before it (their results
  reach it through ``ctx.shared``);
- ``run(ctx: BenchContext) -> dict`` returning ``{"rows": [...], "notes":
  [...], "details": {...}}``; rows come from ``benchmarks.stats.row`` and are
  rendered by ``benchmarks.report``.

To add one (two regions, a 100k-checkpoint catalog, dedup, …): write the
module and append it to SCENARIOS.
"""

from __future__ import annotations

from types import ModuleType

from . import (
    catalog_latest,
    catalog_work,
    cpu,
    dcp_plugin,
    dcp_restore,
    dedup,
    large_files,
    memory,
    peers,
    register_latency,
    registration_rate,
    restore,
    trainer_stall,
    two_regions,
    upload,
    worker_cost,
)

SCENARIOS: list[ModuleType] = [
    upload,
    cpu,
    restore,
    large_files,
    register_latency,
    two_regions,
    registration_rate,
    trainer_stall,
    catalog_latest,
    catalog_work,
    worker_cost,
    dedup,
    memory,
    dcp_plugin,
    peers,
    dcp_restore,
]


def by_name() -> dict[str, ModuleType]:
    return {module.NAME: module for module in SCENARIOS}
