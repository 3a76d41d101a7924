"""The agent's background worker: claims jobs from the catalog and runs them.

Concurrency is a semaphore of slots; a heartbeat extends the leases of the
jobs in hand; ``stop()`` lets running jobs finish for a grace period and then
cancels them and gives them back as retryable, so SIGTERM loses nothing and
SIGKILL loses nothing either (the lease expires, or the next start of this
node's agent releases it at once). If the heartbeat dies (a bug: its own
errors are caught), the worker stops too and ``run()`` raises: without it the
leases of running jobs would expire under them, and the agent must see it.
While the agent drains (``begin_drain``, on SIGTERM) the worker claims only
its own node's work (``queue.node_work``), urgent first: what nobody else can
do once the node is gone.

A job may claim the job it enqueued (``follow_ups``; an upload its commit) so
that the same task runs it right after, with no trip through the queue: no
wake-up, no claim loop, no second slot. The claim is in the catalog like any
other (a kill -9 leaves it to lease expiry or the next start), its lease is
extended by the heartbeat from the moment it is claimed, and a cancelled task
gives its unstarted follow-ups back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ..config import WorkerSettings
from ..db import reading, transaction, transaction_giving_way
from ..models import Job, JobKind
from ..observability import metrics
from ..observability.context import bind_job
from ..storage.base import ObjectStore
from . import queue

log = logging.getLogger("tierckpt.worker")

# The longest pause between two claims while the catalog is unreachable: how
# late, at worst, an agent notices the catalog is back.
OUTAGE_PAUSE_MAX = 5.0


@dataclass
class FollowUps:
    """Jobs claimed by the running job for its task to run next, in order."""

    owner: str
    lease_seconds: float
    jobs: list[Job] = field(default_factory=list)

    def add(self, job: Job, *, first: bool = False) -> None:
        """Call after the transaction that claimed ``job`` has committed;
        ``first``: before the follow-ups added so far."""
        if first:
            self.jobs.insert(0, job)
        else:
            self.jobs.append(job)


_FOLLOW_UPS: ContextVar[FollowUps | None] = ContextVar("tierckpt_follow_ups", default=None)


def follow_ups() -> FollowUps | None:
    """Inside a job the worker runs: where to add a job claimed
    (``queue.claim_queued`` with this owner and lease) to run next in the
    same task. None elsewhere (a handler called directly): leave it queued."""
    return _FOLLOW_UPS.get()


class PermanentJobError(Exception):
    """Retrying cannot help (the source file changed, the input is invalid)."""


def region_store(stores: Mapping[str, ObjectStore], job: Job) -> ObjectStore:
    """The store of the region ``job`` targets. A region this agent has no
    configuration for will not appear by retrying: the job fails."""
    store = stores.get(job.region) if job.region is not None else None
    if store is None:
        raise PermanentJobError(f"region {job.region!r} is not configured on this agent")
    return store


@dataclass
class JobHandler:
    """What a kind of job does. ``run`` does the I/O and then, in one
    transaction, the catalog updates together with ``queue.complete``;
    ``on_failure`` records a permanent failure on the domain rows."""

    run: Callable[[Job], Awaitable[None]]
    on_failure: Callable[[AsyncSession, Job, str], Awaitable[None]]


class Worker:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        handlers: dict[str, JobHandler],
        settings: WorkerSettings,
        node: str,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._handlers = handlers
        self._settings = settings
        self.node = node
        self.owner = f"{node}:{os.getpid()}:{secrets.token_hex(4)}"
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._stopping = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._running: dict[asyncio.Task[None], Job] = {}
        self._follow_ups: dict[asyncio.Task[None], FollowUps] = {}
        self._main: asyncio.Task[None] | None = None
        self._draining = False
        self._grace = settings.shutdown_timeout

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        self._main = asyncio.create_task(self.run(), name="tierckpt-worker")
        return self._main

    async def run(self) -> None:
        await self._release_previous_incarnation()
        heartbeat = asyncio.create_task(self._heartbeat(), name="tierckpt-heartbeat")
        heartbeat.add_done_callback(self._heartbeat_ended)
        try:
            await self._claim_loop()
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self._drain()
        if not heartbeat.cancelled() and heartbeat.exception() is not None:
            raise RuntimeError("the lease heartbeat died") from heartbeat.exception()

    async def stop(self, grace: float | None = None) -> None:
        """Stop claiming; running jobs get ``grace`` seconds (default
        ``shutdown_timeout``) to finish, then are given back."""
        if grace is not None:
            self._grace = max(0.0, grace)
        self._stopping.set()
        self._wakeup.set()
        if self._main is not None:
            await asyncio.gather(self._main, return_exceptions=True)

    def begin_drain(self) -> None:
        """From now on claim only this node's work (the node is going away).
        Running jobs that any agent can run (replicate, verify, delete) are
        given back now: their slots go to the node's own uploads, which
        nobody else can do once the node is gone."""
        self._draining = True
        shared = [
            task
            for task, job in self._running.items()
            if job.node is None and job.kind != JobKind.COMMIT
        ]
        for task in shared:
            task.cancel()  # _execute gives the job back (release)
        if shared:
            log.info("draining: gave back %d job(s) other agents can run", len(shared))
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        return self._main is not None and not self._main.done()

    def wake(self) -> None:
        """Work was just enqueued in this process: look now, not at the next poll."""
        self._wakeup.set()

    @property
    def busy(self) -> int:
        return len(self._running)

    # -- internals -----------------------------------------------------------

    async def _release_previous_incarnation(self) -> None:
        try:
            async with transaction(self._sessionmaker) as session:
                released = await queue.release_node_leases(session, self.node)
            if released:
                log.info(
                    "released %d job(s) left running by a previous agent on %s", released, self.node
                )
        except (OperationalError, DBAPIError, OSError) as exc:
            log.warning("could not release stale leases: %s", exc)

    async def _claim_loop(self) -> None:
        failures = 0  # claims failed in a row: the catalog is unreachable
        while not self._stopping.is_set():
            await self._slots.acquire()
            if self._stopping.is_set():
                self._slots.release()
                break
            # Cleared before looking, not after: a wake-up that arrives while
            # the claim runs must not be lost (it would cost a poll interval).
            self._wakeup.clear()
            try:
                job = await self._claim()
            except (OperationalError, DBAPIError, OSError) as exc:
                # The catalog is unreachable: pause, keep what we hold, retry.
                failures += 1
                if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th… in a row
                    log.warning(
                        "claim failed %d time(s) in a row (catalog unreachable?): %s", failures, exc
                    )
                job = None
            else:
                if failures:
                    log.info("catalog reachable again after %d failed claim(s)", failures)
                failures = 0
            if job is None:
                self._slots.release()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self._pause(failures))
                except TimeoutError:
                    pass
                continue
            task = asyncio.create_task(self._execute(job), name=f"job-{job.id}-{job.kind}")
            self._running[task] = job
            task.add_done_callback(self._finished)

    def _heartbeat_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            self._stopping.set()
            self._wakeup.set()

    def _pause(self, failures: int) -> float:
        """Seconds until the next claim: the poll interval, doubling while the
        catalog stays unreachable, up to OUTAGE_PAUSE_MAX. Every agent of a
        shared catalog polls it; at a fixed pace they would all hammer it
        (connect attempts, log lines) through an outage and its recovery."""
        interval = self._settings.poll_interval
        if not failures:
            return interval
        return max(interval, min(interval * 2 ** min(failures, 16), OUTAGE_PAUSE_MAX))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._follow_ups.pop(task, None)
        self._slots.release()
        # A finished job often enqueues the next (upload -> commit).
        self._wakeup.set()

    async def _claim(self) -> Job | None:
        return await transaction_giving_way(
            self._sessionmaker,
            partial(
                queue.claim,
                owner=self.owner,
                node=self.node,
                lease_seconds=self._settings.lease_seconds,
                node_work_only=self._draining,
            ),
        )

    async def _execute(self, job: Job) -> None:
        """Run ``job``, then the follow-ups it claimed, one after another."""
        task = asyncio.current_task()
        assert task is not None
        pending = FollowUps(self.owner, self._settings.lease_seconds)
        _FOLLOW_UPS.set(pending)  # this task's context only
        self._follow_ups[task] = pending
        try:
            while True:
                await self._execute_one(job)
                if not pending.jobs:
                    return
                job = pending.jobs.pop(0)
                self._running[task] = job
        except asyncio.CancelledError:
            for waiting in pending.jobs:
                await self._settle(waiting, "release", None, self._handlers.get(waiting.kind))
            raise

    async def _execute_one(self, job: Job) -> None:
        handler = self._handlers.get(job.kind)
        try:
            # Job id, kind, run, step, region on every log line of this task.
            await bind_job(job, reading(self._sessionmaker))
            if handler is None:
                raise PermanentJobError(f"no handler for job kind {job.kind!r}")
            if job.attempts > job.max_attempts:
                reason = job.last_error or "lease expired"
                raise PermanentJobError(f"gave up after {job.max_attempts} attempts: {reason}")
            await handler.run(job)
            metrics.observe_job(job.kind, "succeeded")
        except asyncio.CancelledError:
            await self._settle(job, "release", None, handler)
            raise
        except queue.LeaseLost as exc:
            log.warning("%s", exc)
        except PermanentJobError as exc:
            log.error("job %s %s failed permanently: %s", job.id, job.kind, exc)
            await self._settle(job, "fail", str(exc), handler)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if job.attempts >= job.max_attempts:
                log.error(
                    "job %s %s failed after %d attempts: %s",
                    job.id,
                    job.kind,
                    job.attempts,
                    message,
                )
                await self._settle(job, "fail", message, handler)
            else:
                delay = queue.backoff_seconds(
                    job.attempts, self._settings.backoff_base, self._settings.backoff_max
                )
                log.warning(
                    "job %s %s attempt %d failed, retrying in %.1fs: %s",
                    job.id,
                    job.kind,
                    job.attempts,
                    delay,
                    message,
                )
                await self._settle(job, "retry", message, handler, delay)

    async def _settle(
        self,
        job: Job,
        action: str,
        error: str | None,
        handler: JobHandler | None,
        delay: float = 0.0,
    ) -> None:
        metrics.observe_job(job.kind, action)
        try:
            async with transaction(self._sessionmaker) as session:
                if action == "release":
                    await queue.release(session, job)
                elif action == "retry":
                    await queue.retry_later(session, job, error or "", delay)
                else:
                    await queue.fail(session, job, error or "")
                    if handler is not None:
                        await handler.on_failure(session, job, error or "")
        except queue.LeaseLost as exc:
            log.warning("%s", exc)
        except Exception as exc:  # the catalog is down: the lease will expire instead
            log.warning("could not record %s of job %s: %s", action, job.id, exc)

    async def _heartbeat(self) -> None:
        interval = self._settings.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            held = [*self._running.values()]
            held += [j for pending in self._follow_ups.values() for j in pending.jobs]
            tokens = [j.lease_token for j in held if j.lease_token]
            if not tokens:
                continue
            try:
                async with transaction(self._sessionmaker) as session:
                    await queue.extend_leases(session, tokens, self._settings.lease_seconds)
            except Exception as exc:
                log.warning("lease heartbeat failed: %s", exc)

    async def _drain(self) -> None:
        if not self._running:
            return
        tasks = list(self._running)
        _done, pending = await asyncio.wait(tasks, timeout=self._grace)
        for task in pending:
            task.cancel()
        if pending:
            log.info("released %d unfinished job(s) at shutdown", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)
