"""The retention pass the agent runs every ``[retention].interval_seconds``
(assembled in agent.py, timed by periodic.py)."""

from __future__ import annotations

import logging

from ..resources import Resources
from .service import apply_all

log = logging.getLogger("tierckpt.retention")


async def sweep(resources: Resources) -> None:
    outcome = await apply_all(resources)
    if any(outcome.values()):
        log.info("retention pass: %s", outcome)
        resources.wake()
