"""The agent's drain on SIGTERM: its state, and the registrations it refuses.

A preempted node sends SIGTERM to the trainer and the agent at once. The
trainer saves an urgent checkpoint in that moment; an agent that stopped at
once would leave it (and every upload still queued on the node) to a next
start that may never come, since only this node can read this node's SSD.
So the agent drains (server.py starts it, agent.py runs it):

* it keeps serving HTTP, and reads and ``latest`` answer as always;
* a registration with priority ``urgent`` is accepted (the preemption save is
  what the drain is for); a normal one is refused with 503 ``draining``
  (``Retry-After``): the client retries, against the next agent once this
  one is gone, or journals it;
* the worker claims only its node's work, urgent first (jobs/queue.py
  ``node_work``);
* it ends when the node has no queued or running work left and no
  registration arrived for ``[worker] drain_linger_seconds`` (the trainer may
  still be writing), when ``[worker] drain_seconds`` have passed (running
  jobs are then given back as retryable, as at any shutdown), or at once on a
  second SIGTERM or a SIGINT.

A drain starts once and lasts until the process exits.
"""

from __future__ import annotations

import asyncio
import math
import time

from .errors import Unavailable


class Draining(Unavailable):
    code = "draining"


class DrainState:
    def __init__(self) -> None:
        self.started_at: float | None = None  # time.monotonic()
        self.seconds = 0.0
        self.linger = 0.0
        self.last_registration: float | None = None
        self._abort = asyncio.Event()

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def begin(self, seconds: float, linger: float) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()
            self.seconds = seconds
            self.linger = min(linger, seconds)

    def remaining(self) -> float:
        """Seconds left before the deadline (the full budget before a drain)."""
        if self.started_at is None:
            return self.seconds
        return max(0.0, self.started_at + self.seconds - time.monotonic())

    def lingering(self) -> bool:
        """Still inside the linger time after SIGTERM or the last registration."""
        if self.started_at is None:
            return False
        since = max(self.started_at, self.last_registration or 0.0)
        return time.monotonic() < since + self.linger

    def abort(self) -> None:
        """A second SIGTERM or a SIGINT: end the drain now."""
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    async def wait_aborted(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True as soon as the drain is aborted."""
        try:
            await asyncio.wait_for(self._abort.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def admit(self, priority: str) -> None:
        """Refuse a normal registration while draining; note an accepted one."""
        if self.started_at is None:
            return
        if priority != "urgent":
            error = Draining(
                "this agent is shutting down (its node is being drained) and accepts only "
                "urgent registrations: retry against the next agent, or register with "
                'priority "urgent" if this is the save before preemption'
            )
            error.headers = {"Retry-After": str(max(1, math.ceil(self.remaining())))}
            raise error
        self.last_registration = time.monotonic()
