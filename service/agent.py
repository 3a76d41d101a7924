"""The agent process: every background component, assembled in one place.

``AgentProcess.assemble`` builds, from the infrastructure (``Resources``):

* the registration writer (group commit, checkpoints/batching.py), always:
  routes reach it through a dependency (deps.py);
* the registration inbox (checkpoints/inbox.py) with ``[catalog] register_ack
  = "recorded"`` (``auto`` on SQLite): registrations answered once recorded on the node, written
  to the catalog by the writer behind the answer; records an earlier life
  left are taken up at ``start()``;
* the worker with a handler for every job kind (jobs/kinds.py), unless the
  agent runs without one (``[worker] enabled = false``, or a test);
* the periodic passes: the scrubber (``[scrub]``) and the retention sweeper;
* with ``[worker] separate_process`` (`tierckpt serve`, by default), the
  worker and the passes run in a child process instead (worker_process.py),
  so that their Python does not hold up the requests and the registration
  writer on this process's loop; here a ``WorkerChild`` stands for them,
  supervised alike (the child exiting unasked is the worker dying).

``start()`` runs the worker and the passes as supervised tasks: a task that
ends while the agent is running (it never should; their own errors are
caught and retried) is logged with its traceback and recorded in
``failures``, and ``/healthz`` then answers 503 naming it, so an orchestrator's
liveness probe restarts the agent instead of leaving it up without its
background work. ``close()`` stops them in reverse order: the passes (they
only enqueue), then the worker (it lets running jobs finish for a grace period
and gives back the rest), then the registration writer (it finishes the batch
being written; its requests are waiting for the answer).

``drain_node()`` (SIGTERM, see draining.py and server.py) comes before
``close()``: the worker claims only its node's work, urgent first, until none
is left or ``[worker] drain_seconds`` have passed; the jobs still running then
are given back at once, since the time the orchestrator allows is spent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from .background import background
from .checkpoints.batching import RegistrationBatcher
from .checkpoints.inbox import RegistrationInbox, inbox_directory
from .config import Settings
from .draining import DrainState
from .jobs import queue
from .jobs.worker import Worker
from .memory.service import MemoryTier
from .periodic import Periodic
from .resources import Resources, no_memory_tier
from .worker_process import WorkerChild

log = logging.getLogger("tierckpt.agent")


class SideTask(Protocol):
    """A component that runs as a task of its own until stopped."""

    def start(self) -> asyncio.Task[None]: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Failure:
    component: str
    reason: str


def _separate(settings: Settings) -> bool:
    """``[worker] separate_process`` (``auto``: yes)."""
    return settings.worker.separate_process != "no"


class AgentProcess:
    def __init__(
        self,
        resources: Resources,
        registrations: RegistrationBatcher,
        *,
        worker: Worker | WorkerChild | None = None,
        passes: list[Periodic] | None = None,
    ) -> None:
        self.resources = resources
        self.registrations = registrations
        self.worker = worker
        self.passes = passes or []
        self.failures: list[Failure] = []
        self._started: list[tuple[str, SideTask]] = []
        self._closing = False
        self.drain = DrainState()
        # The memory tier (memory/): only with a worker, which persists its segments.
        self.memory: MemoryTier | None = None
        if worker is not None and resources.settings.memory.bytes > 0:
            self.memory = MemoryTier(resources, registrations, self.drain)
            # Uploads read a staged checkpoint from memory while T0 is written.
            resources.open_in_memory = self.memory.open_file
        # Registrations answered once recorded on the node (checkpoints/inbox.py).
        self.inbox: RegistrationInbox | None = None
        if resources.settings.catalog.answer_at == "recorded":
            self.inbox = RegistrationInbox(resources, registrations, inbox_directory(resources))
        # Seconds the worker's running jobs get at close (None: shutdown_timeout).
        self._worker_grace: float | None = None

    @classmethod
    def assemble(
        cls, resources: Resources, *, start_worker: bool = True, worker_process: bool = False
    ) -> AgentProcess:
        """``worker_process``: the worker and the passes run in a child process
        (worker_process.py) when ``[worker] separate_process`` says so; `tierckpt
        serve` asks for it, an app driven in process (tests) runs them here."""
        settings = resources.settings
        registrations = RegistrationBatcher(resources)
        if not (start_worker and settings.worker.enabled):
            return cls(resources, registrations)
        if worker_process and _separate(settings):
            child = WorkerChild(settings)
            # A registration wakes the child's worker (a line on its socket).
            resources.wake = child.wake
            return cls(resources, registrations, worker=child)
        worker, passes = background(resources)
        return cls(resources, registrations, worker=worker, passes=passes)

    @property
    def busy(self) -> int:
        """Jobs the worker is running right now."""
        return self.worker.busy if self.worker is not None else 0

    @property
    def worker_samples(self) -> list[Any]:
        """The worker process's last report of its metrics; none when the
        worker runs in this process (its counts are this process's own)."""
        return self.worker.samples if isinstance(self.worker, WorkerChild) else []

    def start(self) -> None:
        if self.inbox is not None:
            try:
                self.inbox.recover()
            except OSError as exc:
                # Registrations are then answered at their commit: slower, none lost.
                log.error(
                    "registration inbox off: %s cannot be used (%s); registrations are "
                    "answered once committed",
                    self.inbox.directory,
                    exc,
                )
                self.inbox = None
        components: list[tuple[str, SideTask]] = []
        if self.worker is not None:
            components.append(("worker", self.worker))
        if self.memory is not None:
            try:
                # Segments an earlier life staged are persisted first thing.
                self.memory.open()
                components.append(("memory persister", self.memory.persister))
            except OSError as exc:
                # Trainers then write to T0 themselves: slower saves, none lost.
                log.error(
                    "memory tier off: its directory %s cannot be used (%s); set [memory] dir "
                    "to a directory this agent may write, or [memory] bytes = 0",
                    self.memory.arena.root,
                    exc,
                )
                self.memory = None
                self.resources.open_in_memory = no_memory_tier
        components += [(f"{p.name} pass", p) for p in self.passes]
        for name, component in components:
            task = component.start()
            task.add_done_callback(partial(self._ended, name))
            self._started.append((name, component))

    def _ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        if task.cancelled():
            reason = "cancelled"
            log.error("agent component %s was cancelled; the agent is no longer healthy", name)
        elif (exc := task.exception()) is not None:
            reason = f"{type(exc).__name__}: {exc}"
            log.error(
                "agent component %s died; the agent is no longer healthy",
                name,
                exc_info=exc,
            )
        else:
            reason = "stopped"
            log.error("agent component %s stopped; the agent is no longer healthy", name)
        self.failures.append(Failure(name, reason))

    async def drain_node(self) -> bool:
        """Run the drain (draining.py); True if the node's work got done."""
        settings = self.resources.settings.worker
        self.drain.begin(settings.drain_seconds, settings.drain_linger_seconds)
        worker = self.worker
        if worker is None:  # nothing runs here: nothing to wait for
            return True
        worker.begin_drain()
        log.info(
            "draining: running this node's work (urgent first) for up to %.0f s; "
            "normal registrations are refused",
            settings.drain_seconds,
        )
        left: int | None = None
        while worker.alive and not self.drain.aborted:
            try:
                left = await self._node_work_left(worker.node)
                # Checkpoints staged in memory, or recorded and not yet in the
                # catalog, are this node's work too.
                left += len(self.memory.arena.staged()) if self.memory is not None else 0
                left += len(self.inbox) if self.inbox is not None else 0
            except Exception as exc:  # the catalog is down: keep trying till the deadline
                log.warning("drain: could not count this node's work left: %s", exc)
                left = None
            if left == 0 and not self.drain.lingering():
                break
            remaining = self.drain.remaining()
            if remaining <= 0:
                break
            await self.drain.wait_aborted(min(settings.poll_interval, remaining))
        done = left == 0
        # Done: other running jobs (not this node's) get what is left of the
        # drain. Out of time or aborted: the orchestrator's kill is near.
        self._worker_grace = (
            min(settings.shutdown_timeout, self.drain.remaining())
            if done and not self.drain.aborted
            else 0.0
        )
        if done:
            log.info("drain done: no work of this node left")
        else:
            reason = "ended by a second signal" if self.drain.aborted else "out of time"
            log.warning(
                "drain %s with %s job(s) of this node left; they are given back",
                reason,
                "unknown" if left is None else left,
            )
        return done

    async def _node_work_left(self, node: str) -> int:
        maker = self.resources.read_sessionmaker or self.resources.sessionmaker
        async with maker() as session:
            return await queue.node_work_left(session, node)

    async def close(self) -> None:
        self._closing = True
        for _name, component in reversed(self._started):
            if component is self.worker:
                await self.worker.stop(self._worker_grace)
            else:
                await component.stop()
        self._started.clear()
        if self.inbox is not None:
            # Records not written by then stay on disk for the next start.
            await self.inbox.close(self.resources.settings.worker.shutdown_timeout)
        await self.registrations.close()
