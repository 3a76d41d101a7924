"""Group commit for registrations: one writer per agent, one transaction per batch.

Many trainers register at once (every rank of a job, every job on a node).
One transaction and one commit (an fsync on SQLite with ``synchronous=FULL``,
a WAL flush on PostgreSQL) per registration caps the agent at a few hundred
registrations per second at best, and on SQLite the concurrent writers queue
on the database lock with the busy handler's sleep-and-retry.

Instead, each registration is scanned and validated in its own request, then
handed to the agent's writer. The writer takes everything pending, writes it
in one transaction with set-based statements (a handful of statements per
batch, not per registration) and commits once; only then is each request
answered. So a 202 still means "committed", and while one batch commits the
next one gathers: with one request in flight, the latency is one transaction,
under load the commit cost is shared. On SQLite the commit's fsync comes
after the write lock is released (wal_sync.py); the next batch is written
meanwhile. With ``[catalog] register_ack = "committed"`` (the default on
PostgreSQL; on SQLite a new checkpoint is answered before, from the agent's
inbox: inbox.py, the writer taking its record behind the answer) a batch is
answered at its commit, its log flush following at once in the background
(wal_sync's group fsync; ``synchronous_commit = off`` on PostgreSQL): a
flush of the catalog's log costs milliseconds, tens on a disk the trainers'
saves keep busy, and a commit survives a kill -9 without it. With
``"on_disk"`` each batch is answered once its own fsync is done (a
registration arriving while another's WAL is being synced still waits for
the write lock only, not for that fsync).

Isolation between the registrations of a batch:

* Every refusal the catalog decides (409: different content, world size,
  failed or deleted checkpoint) is decided before anything of that
  registration is written, so it fails only that registration.
* A statement the database refuses (an unexpected constraint or value
  error) rolls the batch back; each registration is then written in its own
  transaction, so only the faulty one fails.
* A registration racing the same checkpoint or shard on another agent (one
  shared PostgreSQL catalog) is seen by ``ON CONFLICT DO NOTHING``: the batch
  is rolled back and written again, now seeing the other agent's rows.
* A catalog outage fails the whole batch (no row is left) and every request
  answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from .. import lock_holder
from ..db import create_sync_engine, create_writer_engine
from ..errors import Conflict, catalog_failed, is_catalog_outage
from ..observability import metrics
from ..resources import Resources
from ..wal_sync import wal_sync_for
from ..write_gate import gated, raising_urgent
from .batch_plan import one_statement_may_do
from .batch_write import Outcome, Raced, Registration, write_batch
from .fresh_batch import NotAllNew
from .register_timing import BatchTiming, Phases

log = logging.getLogger("tierckpt.register")
T = TypeVar("T")

# Registrations per transaction. Large enough that 64 concurrent trainers
# go in one or two commits; small enough that one batch's statements stay
# well under the drivers' parameter limits and the write lock is short.
MAX_BATCH = 128
# How many times a batch is written again after it raced another agent.
MAX_RACES = 3
# Run name -> id, for runs known to be committed (runs are never deleted).
RUN_CACHE_SIZE = 10_000
# Checkpoints this writer saw committed, remembered so that their other
# ranks skip the one-statement attempt that would find them (PostgreSQL).
EXISTING_CACHE_SIZE = 4096
# SQLite: the writer's threads; one batch's transaction runs beside the
# fsync of the batch before it.
WRITER_THREADS = 2

# Filled by a batch's transactions on SQLite: what its answer waits for
# (each transaction's fsync; an error raised there fails the batch).
Syncs = list["asyncio.Future[None]"]


class RegistrationBatcher:
    """The agent's registration writer (one per process and catalog, built
    with the agent: agent.py)."""

    def __init__(self, resources: Resources, *, max_batch: int = MAX_BATCH) -> None:
        self.r = resources
        self.engine: AsyncEngine = resources.engine
        self.max_batch = max_batch
        # (registration, its answer, when it was submitted)
        self._pending: list[tuple[Registration, asyncio.Future[Outcome], float]] = []
        self._writer: asyncio.Task[None] | None = None
        # Batches committed and waiting for their fsync before they answer.
        self._answering: set[asyncio.Task[None]] = set()
        self._run_ids: dict[str, int] = {}
        # Eager lock: the worker may run in another process (worker_process.py),
        # where the write gate does not put the registrations first.
        self._sync_engine = create_sync_engine(self.engine, eager_lock=True)
        # Answer once committed, or once the commit is on disk too (config.py).
        self.ack_on_disk = resources.settings.catalog.answer_at == "on_disk"
        self._writer_engine = create_writer_engine(self.engine, synchronous_commit=self.ack_on_disk)
        # Its own threads: the default executor may be queued with the
        # uploads' file reads and hashing.
        self._thread = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="tierckpt-register")
        # (run, step) of checkpoints known to exist, newest last.
        self._existing: OrderedDict[tuple[str, int], None] = OrderedDict()
        # PostgreSQL: try new checkpoints in one statement (fresh_batch.py).
        self.one_statement = self._writer_engine is not None
        self.fresh_batches = 0  # batches written in one statement
        self.fresh_misses = 0  # one-statement attempts that found a checkpoint
        self.batches = 0  # statistics, for tests and logs
        self.largest_batch = 0

    async def close(self) -> None:
        """At shutdown: let the batch being written finish (its requests are
        waiting for the answer), then close the SQLite writer's connection."""
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.gather(writer, return_exceptions=True)
        await asyncio.gather(*self._answering, return_exceptions=True)
        if self._sync_engine is not None:
            self._sync_engine.dispose()
        if self._writer_engine is not None:
            await self._writer_engine.dispose()
        self._thread.shutdown(wait=False)

    async def submit(self, registration: Registration) -> Outcome:
        """Queue one registration; returns once its batch is committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._pending.append((registration, future, time.perf_counter()))
        # SQLite with the worker process: from now on its transactions wait
        # before they begin, so the lock is free when this batch asks for it
        # (write_gate.UrgentFlag); lowered once the batch holds the lock, so
        # that the worker waits for one batch at most, never for a stream.
        flag = raising_urgent()
        if flag is not None:
            flag.raise_()
        writer = self._writer
        if writer is None or writer.done() or writer.get_loop() is not loop:
            # The writer exists only while there is work: nothing to stop at
            # shutdown, and no task bound to a loop that is gone.
            self._writer = asyncio.create_task(self._drain(), name="register-writer")
        return await future

    async def _drain(self) -> None:
        try:
            await self._drain_pending()
        finally:
            flag = raising_urgent()
            if flag is not None and not self._pending:
                flag.lower()

    async def _drain_pending(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            # A request cancelled while waiting (client gone) is not written.
            batch = [(reg, fut, at) for reg, fut, at in batch if not fut.done()]
            if not batch:
                continue
            started = time.perf_counter()
            phases = Phases()
            syncs: Syncs = []
            try:
                results = await self._write([reg for reg, _, _ in batch], phases, syncs)
            except Exception as exc:
                _fail(batch, exc)
                continue
            except BaseException:
                # Cancelled (the loop is shutting down): nobody is answered.
                for _reg, fut, *_ in [*batch, *self._pending]:
                    fut.cancel()
                self._pending.clear()
                raise
            if not syncs:
                _answer(batch, results, phases, started)
                continue
            # Committed; on disk once its fsync is done. The next batch is
            # written meanwhile.
            task = asyncio.create_task(
                _answer_when_synced(batch, results, phases, started, syncs),
                name="register-answer",
            )
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _write(
        self, items: list[Registration], phases: Phases, syncs: Syncs
    ) -> list[Outcome | BaseException]:
        """The whole batch in one transaction; if the catalog refuses it, one by one."""
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(items))
        try:
            return await self._write_retrying(items, phases, syncs)
        except Exception as exc:
            self._run_ids.clear()
            if is_catalog_outage(exc) or len(items) == 1:
                raise
            log.info(
                "a batch of %d registrations was refused (%s); writing them one by one",
                len(items),
                exc,
            )
        results: list[Outcome | BaseException] = []
        for number, item in enumerate(items):
            try:
                results.extend(await self._write_retrying([item], phases, syncs))
            except Exception as exc:
                self._run_ids.clear()
                if is_catalog_outage(exc):
                    # Those written so far keep their answer; the rest were not written.
                    results.extend([exc] * (len(items) - number))
                    break
                results.append(exc)
        return results

    async def _write_retrying(
        self, items: list[Registration], phases: Phases, syncs: Syncs
    ) -> list[Outcome | BaseException]:
        # PostgreSQL: a batch of checkpoints not known to exist is written in
        # one statement first (fresh_batch.py), the full way if one did.
        assume_new = (
            self.one_statement
            and one_statement_may_do(items, self._run_ids)
            and not any((i.request.run, i.request.step) in self._existing for i in items)
        )
        for attempt in range(MAX_RACES + 1):
            try:
                results, new_runs = await self._transaction(items, phases, syncs, assume_new)
            except NotAllNew:
                self.fresh_misses += 1
                assume_new = False
                continue
            except Raced:
                self._run_ids.clear()
                if attempt == MAX_RACES:
                    raise Conflict(
                        "the checkpoint kept changing under concurrent registrations; retry",
                        code="concurrent_change",
                    ) from None
                continue
            if self.one_statement:
                self._remember_existing(items, fresh=assume_new)
            # Committed: only now may the new runs' ids be trusted.
            if len(self._run_ids) + len(new_runs) > RUN_CACHE_SIZE:
                self._run_ids.clear()
            self._run_ids.update(new_runs)
            if any(isinstance(r, Outcome) and r.created for r in results):
                self.r.wake()
                for item, result in zip(items, results, strict=True):
                    if isinstance(result, Outcome) and result.created:
                        metrics.observe_registration(item.request.priority)
            return results
        raise AssertionError("unreachable")

    def _remember_existing(self, items: list[Registration], *, fresh: bool) -> None:
        """Committed: these checkpoints exist now (their later ranks skip the
        one-statement attempt)."""
        self.fresh_batches += fresh
        for item in items:
            key = (item.request.run, item.request.step)
            self._existing[key] = None
            self._existing.move_to_end(key)
        while len(self._existing) > EXISTING_CACHE_SIZE:
            self._existing.popitem(last=False)

    async def _transaction(
        self, items: list[Registration], phases: Phases, syncs: Syncs, assume_new: bool = False
    ) -> tuple[list[Outcome | BaseException], dict[str, int]]:
        """One transaction, committed on return (on SQLite, its fsync is
        added to ``syncs``, still running).

        The batch is plain synchronous Core code on a ``Connection``. On
        SQLite it runs on a pysqlite connection in a worker thread: one
        thread hop per batch instead of three or four per statement through
        aiosqlite (which, on a busy machine, each cost a scheduling delay).
        On PostgreSQL it runs through ``run_sync`` on an asyncpg connection.
        """
        if self._sync_engine is not None:
            # Ahead of every background transaction waiting (write_gate.py).
            waited = time.perf_counter()
            async with gated(self.r.sessionmaker):
                phases.add("gate", time.perf_counter() - waited)
                loop = asyncio.get_running_loop()
                committed: asyncio.Future[tuple[list[Outcome | BaseException], dict[str, int]]]
                committed = loop.create_future()

                def on_commit(out: tuple[list[Outcome | BaseException], dict[str, int]]) -> None:
                    loop.call_soon_threadsafe(_settle, committed, out)

                synced = loop.run_in_executor(
                    self._thread,
                    self._sync_transaction,
                    self._sync_engine,
                    items,
                    phases,
                    on_commit,
                )
                # The thread reports the commit before its fsync, and the
                # loop hears of it before the thread's end: a transaction
                # that failed ends the thread with ``committed`` not done.
                await asyncio.wait((committed, synced), return_when=asyncio.FIRST_COMPLETED)
                if not committed.done():
                    synced.result()  # raises what failed the transaction
                    raise AssertionError("a transaction ended without its commit")
                if self.ack_on_disk:
                    syncs.append(synced)
                return committed.result()
        began = time.perf_counter()
        async with (self._writer_engine or self.engine).connect() as conn:
            phases.add("lock", time.perf_counter() - began)
            if assume_new:
                # One statement (fresh_batch.py) is a transaction of its own:
                # no BEGIN and COMMIT round trips around it.
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                wrote = time.perf_counter()
                out = await conn.run_sync(write_batch, items, self.r, self._run_ids, True)
                phases.add("write", time.perf_counter() - wrote)
                await conn.commit()
                return out
            async with conn.begin():
                wrote = time.perf_counter()
                out = await conn.run_sync(write_batch, items, self.r, self._run_ids)
                phases.add("write", time.perf_counter() - wrote)
                committing = time.perf_counter()
            phases.add("commit", time.perf_counter() - committing)
            return out

    def _sync_transaction(
        self,
        engine: Engine,
        items: list[Registration],
        phases: Phases,
        on_commit: Callable[[tuple[list[Outcome | BaseException], dict[str, int]]], None],
    ) -> None:
        began = time.perf_counter()
        held: lock_holder.Held | None = None
        try:
            with engine.connect() as conn:
                # BEGIN IMMEDIATE (db._on_begin): waits for SQLite's write lock.
                with conn.begin():
                    # No garbage collection until the COMMIT has released the
                    # lock (lock_holder.py): the trainers wait for all of it,
                    # and so does every other writer.
                    held = lock_holder.holding()
                    wrote = time.perf_counter()
                    phases.add("lock", wrote - began)
                    flag = raising_urgent()
                    if flag is not None:
                        flag.lower()
                    out = write_batch(conn, items, self.r, self._run_ids)
                    committing = time.perf_counter()
                    phases.add("write", committing - wrote)
                synced = time.perf_counter()
                phases.add("commit", synced - committing)
        finally:
            if held is not None:
                lock_holder.released(held)
        # COMMIT released the lock (synchronous=NORMAL): the next batch may be
        # written while this one's WAL goes to disk (wal_sync.py); the
        # worker's writers no longer wait for it either.
        on_commit(out)
        wal = wal_sync_for(engine.url.database or "")
        if not self.ack_on_disk:
            # Answered already: the fsync joins the others on wal_sync's thread.
            wal.sync_soon(_report_late_sync)
            return
        # The answer waits for it: right here, without a hand-off.
        wal.sync()
        phases.add("sync", time.perf_counter() - synced)


def _report_late_sync(error: BaseException | None) -> None:
    """How the fsync of registrations answered before it went (wal_sync's
    thread). A failed one leaves them committed but not known to be on disk:
    a power loss could lose them, a kill -9 cannot."""
    if error is not None:
        log.error(
            "the catalog could not write its log to disk (%s): registrations answered "
            "since its last flush may not survive a power loss of this machine",
            error,
        )


def _settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(
    batch: list[tuple[Registration, asyncio.Future[Outcome], float]], exc: BaseException
) -> None:
    for _reg, fut, _at in batch:
        if not fut.done():
            fut.set_exception(exc)


def _answer(
    batch: list[tuple[Registration, asyncio.Future[Outcome], float]],
    results: list[Outcome | BaseException],
    phases: Phases,
    started: float,
) -> None:
    for (_reg, fut, submitted), result in zip(batch, results, strict=True):
        if fut.done():
            continue
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            timing = BatchTiming.of(phases, queued=started - submitted, size=len(batch))
            fut.set_result(dataclasses.replace(result, timing=timing))


async def _answer_when_synced(
    batch: list[tuple[Registration, asyncio.Future[Outcome], float]],
    results: list[Outcome | BaseException],
    phases: Phases,
    started: float,
    syncs: Syncs,
) -> None:
    """Answer a committed batch once its fsyncs are done; if one failed, the
    batch's registrations are not known to be on disk: they fail with a 503,
    and registering again (the same content: idempotent) answers once the
    catalog's log can be synced."""
    try:
        await asyncio.gather(*syncs)
    except OSError as exc:
        _fail(
            batch,
            catalog_failed(
                f"the catalog could not write its log to disk ({exc}); "
                "the registration is not known to be durable: register it again"
            ),
        )
        return
    except Exception as exc:
        _fail(batch, exc)
        return
    _answer(batch, results, phases, started)
