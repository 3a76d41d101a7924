"""The agent's periodic retention pass (every ``[retention].interval_seconds``)."""

from __future__ import annotations

import asyncio
import logging

from ..resources import Resources
from .service import apply_all

log = logging.getLogger("tierckpt.retention")


class RetentionSweeper:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="tierckpt-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.r.settings.retention.interval_seconds)
            try:
                outcome = await apply_all(self.r)
                if any(outcome.values()):
                    log.info("retention pass: %s", outcome)
                    self.r.wake_worker()
            except Exception as exc:  # the catalog may be down; next time
                log.warning("retention pass failed: %s", exc)
