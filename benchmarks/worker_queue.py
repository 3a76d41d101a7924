"""How much work an agent's worker has before it: queued and running jobs,
read from the agent's ``/metrics`` (the ``tierckpt_jobs`` gauge)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

BUSY = frozenset({"queued", "running"})


def busy_jobs(url: str) -> int:
    """Queued + running jobs of the agent at ``url``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    busy = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "tierckpt_jobs":
            busy += sum(s.value for s in family.samples if s.labels.get("state") in BUSY)
    return int(busy)
