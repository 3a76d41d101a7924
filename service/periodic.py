"""A pass the agent runs every N seconds (the scrubber, the retention sweeper).

One failed pass is logged and the next one runs on time: a pass usually fails
because the catalog or a region is briefly down, and the following pass
covers what this one missed. Only ``stop()`` (or a bug in this loop) ends the
task; the agent supervises it (agent.py) so such an end is seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


class Periodic:
    """Run ``tick`` every ``interval`` seconds, the first time after ``first_delay``."""

    def __init__(
        self,
        name: str,
        tick: Callable[[], Awaitable[object]],
        interval: float,
        *,
        log: logging.Logger,
        first_delay: float = 0.0,
    ) -> None:
        self.name = name
        self.tick = tick
        self.interval = interval
        self.first_delay = first_delay
        self.log = log
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name=f"tierckpt-{self.name}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        if self.first_delay:
            await asyncio.sleep(self.first_delay)
        while True:
            try:
                await self.tick()
            except Exception as exc:  # the catalog or a region may be down: next time
                self.log.warning("%s pass failed: %s", self.name, exc)
            await asyncio.sleep(self.interval)
