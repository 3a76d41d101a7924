"""How much work an agent's worker has before it: queued and running jobs,
read from the agent's ``/metrics`` (the ``tierckpt_jobs`` gauge)."""

from __future__ import annotations

import httpx


def busy_jobs(url: str) -> int:
    """Queued + running jobs of the agent at ``url``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    busy = 0.0
    for line in text.splitlines():
        if line.startswith("tierckpt_jobs{") and (
            'state="queued"' in line or 'state="running"' in line
        ):
            busy += float(line.rsplit(" ", 1)[1])
    return int(busy)
