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
under load the commit cost is shared.

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
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from ..db import create_sync_engine
from ..errors import ApiError, Conflict, is_catalog_outage
from ..jobs import queue
from ..models import (
    PRIORITY,
    Checkpoint,
    CheckpointState,
    File,
    Job,
    JobKind,
    JobState,
    Replica,
    ReplicaState,
    Run,
    Shard,
    ShardState,
    utcnow,
)
from ..observability import metrics
from ..resources import Resources
from ..storage import layout
from .scan import ScannedShard
from .schemas import CheckpointOut, RefOut, RegisterRequest, ReplicaOut, ShardOut

log = logging.getLogger("tierckpt.register")

# Registrations per transaction. Large enough that 64 concurrent trainers
# go in one or two commits; small enough that one batch's statements stay
# well under the drivers' parameter limits and the write lock is short.
MAX_BATCH = 128
# How many times a batch is written again after it raced another agent.
MAX_RACES = 3
# Run name -> id, for runs known to be committed (runs are never deleted).
RUN_CACHE_SIZE = 10_000

CHECKPOINTS = cast(Table, Checkpoint.__table__)
SHARDS = cast(Table, Shard.__table__)
FILES = cast(Table, File.__table__)
REPLICAS = cast(Table, Replica.__table__)
RUNS = cast(Table, Run.__table__)
JOBS = cast(Table, Job.__table__)


def _expanding(name: str) -> Any:
    return bindparam(name, expanding=True)


# Every statement of a batch, built once: built per batch, their
# construction and cache keys were ~10 % of the writer's CPU (py-spy, one
# registration per batch). IN lists are expanding parameters, so the
# compiled SQL is cached and only the list is filled in per execution.
_RUN_IDS = select(RUNS.c.name, RUNS.c.id).where(RUNS.c.name.in_(_expanding("names")))
_EXISTING = (
    select(
        CHECKPOINTS.c.id,
        CHECKPOINTS.c.run_id,
        CHECKPOINTS.c.step,
        CHECKPOINTS.c.world_size,
        CHECKPOINTS.c.state,
        CHECKPOINTS.c.priority,
        CHECKPOINTS.c.error,
    )
    # Two plain IN lists, not a tuple IN (whose values SQLAlchemy renders
    # into the SQL text at every execution); the rows of other pairs this may
    # match are skipped by the caller.
    .where(
        CHECKPOINTS.c.run_id.in_(_expanding("run_ids")),
        CHECKPOINTS.c.step.in_(_expanding("steps")),
    )
    .order_by(CHECKPOINTS.c.run_id, CHECKPOINTS.c.step)
)
# What exists already, locked against the other agents until commit.
_EXISTING_LOCKED = _EXISTING.with_for_update()
_SHARD_PRINTS = select(SHARDS.c.checkpoint_id, SHARDS.c.rank, SHARDS.c.fingerprint).where(
    SHARDS.c.checkpoint_id.in_(_expanding("ids"))
)
_CHILDREN = (
    select(CHECKPOINTS.c.parent_run, CHECKPOINTS.c.parent_step, RUNS.c.name, CHECKPOINTS.c.step)
    .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
    .where(
        CHECKPOINTS.c.parent_run.in_(_expanding("runs")),
        CHECKPOINTS.c.parent_step.in_(_expanding("steps")),
    )
    .order_by(RUNS.c.name, CHECKPOINTS.c.step)
)
_GROW = (
    update(CHECKPOINTS)
    .where(CHECKPOINTS.c.id == bindparam("b_id"))
    .values(
        total_bytes=CHECKPOINTS.c.total_bytes + bindparam("b_bytes"),
        file_count=CHECKPOINTS.c.file_count + bindparam("b_files"),
        priority=bindparam("b_priority"),
        updated_at=bindparam("b_now"),
    )
)
_PROMOTE_CHECKPOINTS = (
    update(CHECKPOINTS)
    .where(CHECKPOINTS.c.id.in_(_expanding("ids")))
    .values(priority="urgent", updated_at=bindparam("now"))
)
_PROMOTE_JOBS = (
    update(JOBS)
    .where(JOBS.c.checkpoint_id.in_(_expanding("ids")), JOBS.c.state == JobState.QUEUED.value)
    .values(priority=PRIORITY["urgent"])
)


@dataclass(frozen=True)
class _Inserts:
    """The dialect's INSERT … ON CONFLICT DO NOTHING statements."""

    runs: Any
    checkpoints: Any
    shards: Any

    @classmethod
    def of(cls, dialect: Any) -> _Inserts:
        return cls(
            runs=dialect.insert(RUNS).on_conflict_do_nothing(index_elements=["name"]),
            checkpoints=dialect.insert(CHECKPOINTS)
            .on_conflict_do_nothing(index_elements=["run_id", "step"])
            .returning(CHECKPOINTS.c.id, CHECKPOINTS.c.run_id, CHECKPOINTS.c.step),
            shards=dialect.insert(SHARDS)
            .on_conflict_do_nothing(index_elements=["checkpoint_id", "rank"])
            .returning(SHARDS.c.id, SHARDS.c.checkpoint_id, SHARDS.c.rank),
        )


_INSERTS = {"postgresql": _Inserts.of(postgresql), "sqlite": _Inserts.of(sqlite)}


@dataclass(frozen=True)
class Registration:
    """One validated registration: the request and what the scan found."""

    request: RegisterRequest
    scanned: ScannedShard
    hashes: dict[str, str]
    fingerprint: str


@dataclass(frozen=True)
class Outcome:
    created: bool
    # Built from what was written when the whole checkpoint is from this
    # batch; None when the caller must read it back (it existed before).
    record: CheckpointOut | None


class _Raced(Exception):
    """Another agent inserted a row this batch meant to insert."""


@dataclass
class _Planned:
    """A checkpoint as this batch sees it: existing or about to be created."""

    key: tuple[int, int]
    run: str
    id: int | None
    new: bool
    world_size: int
    state: str
    priority: str
    error: str | None
    first: RegisterRequest | None = None  # the registration creating it
    shards: dict[int, str] = field(default_factory=dict)  # rank -> fingerprint
    added: list[tuple[int, Registration]] = field(default_factory=list)  # (index, reg)
    promote: bool = False
    created_at: Any = None


class RegistrationBatcher:
    """The agent's registration writer (one per process and catalog)."""

    def __init__(self, resources: Resources, *, max_batch: int = MAX_BATCH) -> None:
        self.r = resources
        self.engine: AsyncEngine = resources.engine
        self.max_batch = max_batch
        self._pending: list[tuple[Registration, asyncio.Future[Outcome]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._run_ids: dict[str, int] = {}
        self._sync_engine = create_sync_engine(self.engine)
        self.batches = 0  # statistics, for tests and logs
        self.largest_batch = 0

    async def close(self) -> None:
        """At shutdown: let the batch being written finish (its requests are
        waiting for the answer), then close the SQLite writer's connection."""
        writer = self._writer
        if writer is not None and not writer.done():
            await asyncio.gather(writer, return_exceptions=True)
        if self._sync_engine is not None:
            self._sync_engine.dispose()

    async def submit(self, registration: Registration) -> Outcome:
        """Queue one registration; returns once its batch is committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._pending.append((registration, future))
        writer = self._writer
        if writer is None or writer.done() or writer.get_loop() is not loop:
            # The writer exists only while there is work: nothing to stop at
            # shutdown, and no task bound to a loop that is gone.
            self._writer = asyncio.create_task(self._drain(), name="register-writer")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[: self.max_batch]
            del self._pending[: self.max_batch]
            # A request cancelled while waiting (client gone) is not written.
            batch = [(reg, fut) for reg, fut in batch if not fut.done()]
            if not batch:
                continue
            try:
                results = await self._write([reg for reg, _ in batch])
            except Exception as exc:
                for _reg, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            except BaseException:
                # Cancelled (the loop is shutting down): nobody is answered.
                for _reg, fut in [*batch, *self._pending]:
                    fut.cancel()
                self._pending.clear()
                raise
            for (_reg, fut), result in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    async def _write(self, items: list[Registration]) -> list[Outcome | BaseException]:
        """The whole batch in one transaction; if the catalog refuses it, one by one."""
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(items))
        try:
            return await self._write_retrying(items)
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
                results.extend(await self._write_retrying([item]))
            except Exception as exc:
                self._run_ids.clear()
                if is_catalog_outage(exc):
                    # Those written so far keep their answer; the rest were not written.
                    results.extend([exc] * (len(items) - number))
                    break
                results.append(exc)
        return results

    async def _write_retrying(self, items: list[Registration]) -> list[Outcome | BaseException]:
        for attempt in range(MAX_RACES + 1):
            try:
                results, new_runs = await self._transaction(items)
            except _Raced:
                self._run_ids.clear()
                if attempt == MAX_RACES:
                    raise Conflict(
                        "the checkpoint kept changing under concurrent registrations; retry",
                        code="concurrent_change",
                    ) from None
                continue
            # Committed: only now may the new runs' ids be trusted.
            if len(self._run_ids) + len(new_runs) > RUN_CACHE_SIZE:
                self._run_ids.clear()
            self._run_ids.update(new_runs)
            if any(isinstance(r, Outcome) and r.created for r in results):
                self.r.wake_worker()
                for item, result in zip(items, results, strict=True):
                    if isinstance(result, Outcome) and result.created:
                        metrics.observe_registration(item.request.priority)
            return results
        raise AssertionError("unreachable")

    async def _transaction(
        self, items: list[Registration]
    ) -> tuple[list[Outcome | BaseException], dict[str, int]]:
        """One transaction, committed on return.

        The batch is plain synchronous Core code on a ``Connection``. On
        SQLite it runs on a pysqlite connection in one worker thread: one
        thread hop per batch instead of three or four per statement through
        aiosqlite (which, on a busy machine, each cost a scheduling delay).
        On PostgreSQL it runs through ``run_sync`` on an asyncpg connection.
        """
        if self._sync_engine is not None:
            return await asyncio.to_thread(self._sync_transaction, self._sync_engine, items)
        async with self.engine.connect() as conn, conn.begin():
            return await conn.run_sync(self._write_batch, items)

    def _sync_transaction(
        self, engine: Engine, items: list[Registration]
    ) -> tuple[list[Outcome | BaseException], dict[str, int]]:
        with engine.begin() as conn:
            return self._write_batch(conn, items)

    def _run_ids_of(
        self, conn: Connection, inserts: _Inserts, names: set[str], now: Any
    ) -> tuple[dict[str, int], dict[str, int]]:
        """(id of every run named, the ones not cached before)."""
        known = {name: self._run_ids[name] for name in names if name in self._run_ids}
        missing = sorted(names - known.keys())
        fetched: dict[str, int] = {}
        if missing:
            conn.execute(inserts.runs, [{"name": name, "created_at": now} for name in missing])
            rows = conn.execute(_RUN_IDS, {"names": missing})
            fetched = {name: run_id for name, run_id in rows}
        return {**known, **fetched}, fetched

    def _write_batch(
        self, conn: Connection, items: list[Registration]
    ) -> tuple[list[Outcome | BaseException], dict[str, int]]:
        settings = self.r.settings
        node = settings.server.node
        is_pg = conn.dialect.name == "postgresql"
        inserts = _INSERTS[conn.dialect.name]
        now = utcnow()

        run_ids, new_runs = self._run_ids_of(conn, inserts, {i.request.run for i in items}, now)
        keys = sorted({(run_ids[i.request.run], i.request.step) for i in items})

        plans: dict[tuple[int, int], _Planned] = {}
        names = {run_id: name for name, run_id in run_ids.items()}
        wanted = set(keys)
        existing = conn.execute(
            _EXISTING_LOCKED if is_pg else _EXISTING,
            {
                "run_ids": sorted({run_id for run_id, _ in keys}),
                "steps": sorted({step for _, step in keys}),
            },
        )
        for row in existing:
            key = (row.run_id, row.step)
            if key not in wanted:
                continue
            plans[key] = _Planned(
                key=key,
                run=names[row.run_id],
                id=row.id,
                new=False,
                world_size=row.world_size,
                state=row.state,
                priority=row.priority,
                error=row.error,
            )
        if plans:
            by_id = {p.id: p for p in plans.values()}
            for checkpoint_id, rank, print_ in conn.execute(_SHARD_PRINTS, {"ids": list(by_id)}):
                by_id[checkpoint_id].shards[rank] = print_

        results: list[Outcome | BaseException | None] = [None] * len(items)
        idempotent: list[tuple[int, _Planned]] = []
        for index, item in enumerate(items):
            request = item.request
            key = (run_ids[request.run], request.step)
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = _Planned(
                    key=key,
                    run=request.run,
                    id=None,
                    new=True,
                    world_size=request.world_size,
                    state=CheckpointState.REGISTERED,
                    priority=request.priority,
                    error=None,
                    first=request,
                    created_at=now,
                )
            try:
                self._decide(plan, index, item)
            except ApiError as exc:
                results[index] = exc
                continue
            if plan.added and plan.added[-1][0] == index:
                continue
            idempotent.append((index, plan))

        self._insert(conn, inserts, plans, now, node)

        # Build the answers. A checkpoint created by this batch is answered
        # from what was written; anything older is read back by the caller.
        children = self._children(conn, [p for p in plans.values() if p.new and p.added])
        records: dict[tuple[int, int], CheckpointOut] = {}
        for plan in plans.values():
            if plan.new and plan.added:
                records[plan.key] = self._record(plan, children.get((plan.run, plan.key[1]), []))
        for plan in plans.values():
            for index, _reg in plan.added:
                results[index] = Outcome(created=True, record=records.get(plan.key))
        for index, plan in idempotent:
            results[index] = Outcome(created=False, record=records.get(plan.key))
        done: list[Outcome | BaseException] = []
        for result in results:
            assert result is not None
            done.append(result)
        return done, new_runs

    @staticmethod
    def _decide(plan: _Planned, index: int, item: Registration) -> None:
        """Same rules as one registration alone; raises before anything is written."""
        request = item.request
        if plan.world_size != request.world_size:
            raise Conflict(
                f"{request.run} step {request.step} is registered with world_size "
                f"{plan.world_size}, not {request.world_size}"
            )
        existing = plan.shards.get(request.rank)
        if existing is not None:
            if existing != item.fingerprint:
                raise Conflict(
                    f"{request.run} step {request.step} rank {request.rank} is already "
                    "registered with different content; register the new content under a new step"
                )
            if request.priority == "urgent" and plan.priority != "urgent":
                # A preemption notice on a step already queued: promote it
                # (and its queued work) instead of leaving it behind others.
                plan.priority = "urgent"
                plan.promote = True
            return
        if plan.state in (CheckpointState.FAILED, CheckpointState.DELETED):
            raise Conflict(
                f"{request.run} step {request.step} is {plan.state}"
                f"{': ' + plan.error if plan.error else ''}; register a new step"
            )
        plan.shards[request.rank] = item.fingerprint
        plan.added.append((index, item))
        if request.priority == "urgent" and plan.priority != "urgent":
            plan.priority = "urgent"
            plan.promote = not plan.new

    def _insert(
        self,
        conn: Connection,
        inserts: _Inserts,
        plans: dict[tuple[int, int], _Planned],
        now: Any,
        node: str,
    ) -> None:
        settings = self.r.settings
        ordered = [plans[key] for key in sorted(plans)]
        new = [p for p in ordered if p.new and p.added]
        if new:
            rows = []
            for plan in new:
                first = plan.first
                assert first is not None
                rows.append(
                    {
                        "run_id": plan.key[0],
                        "step": plan.key[1],
                        "state": CheckpointState.REGISTERED.value,
                        "world_size": first.world_size,
                        "epoch": first.epoch,
                        "priority": plan.priority,
                        "metrics": first.metrics,
                        "metadata": first.metadata,
                        "parent_run": first.parent.run if first.parent else None,
                        "parent_step": first.parent.step if first.parent else None,
                        "write_seconds": first.write_seconds,
                        "total_bytes": sum(r.scanned.total_bytes for _, r in plan.added),
                        "file_count": sum(len(r.scanned.files) for _, r in plan.added),
                        "created_at": now,
                        "updated_at": now,
                        "pinned": False,
                    }
                )
            inserted = conn.execute(inserts.checkpoints, rows)
            for checkpoint_id, run_id, step in inserted:
                plans[(run_id, step)].id = checkpoint_id
            if any(p.id is None for p in new):
                raise _Raced()
            replicas = [
                {
                    "checkpoint_id": plan.id,
                    "region": region,
                    "state": ReplicaState.PENDING.value,
                    "uri": store.uri(layout.step_prefix(plan.run, plan.key[1])),
                    "created_at": now,
                }
                for plan in new
                for region, store in self.r.stores.items()
            ]
            if replicas:
                conn.execute(REPLICAS.insert(), replicas)

        adding = [(plan, reg) for plan in ordered for _, reg in plan.added]
        if not adding:
            self._promote(conn, ordered)
            return
        shard_rows = [
            {
                "checkpoint_id": plan.id,
                "rank": reg.request.rank,
                "node": node,
                "path": str(reg.scanned.directory),
                "is_directory": reg.scanned.is_directory,
                "state": ShardState.REGISTERED.value,
                "fingerprint": reg.fingerprint,
                "created_at": now,
            }
            for plan, reg in adding
        ]
        inserted = conn.execute(inserts.shards, shard_rows)
        shard_ids = {(checkpoint_id, rank): shard_id for shard_id, checkpoint_id, rank in inserted}
        if len(shard_ids) != len(shard_rows):
            raise _Raced()

        files: list[dict[str, Any]] = []
        jobs = []
        region = settings.primary_region.name
        for plan, reg in adding:
            assert plan.id is not None
            shard_id = shard_ids[(plan.id, reg.request.rank)]
            files.extend(
                {
                    "shard_id": shard_id,
                    "path": f.path,
                    "size": f.size,
                    "mtime_ns": f.mtime_ns,
                    "expected_sha256": reg.hashes.get(f.path),
                }
                for f in reg.scanned.files
            )
            jobs.append(
                queue.job_values(
                    JobKind.UPLOAD,
                    plan.id,
                    shard_id=shard_id,
                    region=region,
                    node=node,
                    priority=PRIORITY[reg.request.priority],
                    max_attempts=settings.worker.max_attempts,
                    now=now,
                )
            )
        conn.execute(FILES.insert(), files)

        grown = [p for p in ordered if not p.new and p.added]
        if grown:
            # Another rank of an existing checkpoint: its totals grow.
            conn.execute(
                _GROW,
                [
                    {
                        "b_id": p.id,
                        "b_bytes": sum(r.scanned.total_bytes for _, r in p.added),
                        "b_files": sum(len(r.scanned.files) for _, r in p.added),
                        "b_priority": p.priority,
                        "b_now": now,
                    }
                    for p in grown
                ],
            )
        queue.enqueue_many(conn, jobs)
        self._promote(conn, ordered)

    @staticmethod
    def _promote(conn: Connection, ordered: Sequence[_Planned]) -> None:
        promoted = [p.id for p in ordered if p.promote and p.id is not None]
        if not promoted:
            return
        conn.execute(_PROMOTE_CHECKPOINTS, {"ids": promoted, "now": utcnow()})
        conn.execute(_PROMOTE_JOBS, {"ids": promoted})

    @staticmethod
    def _children(
        conn: Connection, plans: list[_Planned]
    ) -> dict[tuple[str, int], list[tuple[str, int]]]:
        """Checkpoints registered earlier that name a new one as their parent."""
        if not plans:
            return {}
        rows = conn.execute(
            _CHILDREN,
            {"runs": sorted({p.run for p in plans}), "steps": sorted({p.key[1] for p in plans})},
        )
        wanted = {(p.run, p.key[1]) for p in plans}
        children: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for parent_run, parent_step, name, step in rows:
            if (parent_run, parent_step) not in wanted:
                continue
            children.setdefault((parent_run, parent_step), []).append((name, step))
        return children

    def _record(self, plan: _Planned, children: list[tuple[str, int]]) -> CheckpointOut:
        first = plan.first
        assert first is not None
        node = self.r.settings.server.node
        added = sorted((reg for _, reg in plan.added), key=lambda r: r.request.rank)
        return CheckpointOut(
            run=plan.run,
            step=plan.key[1],
            state=CheckpointState.REGISTERED,
            world_size=first.world_size,
            epoch=first.epoch,
            priority=plan.priority,
            metrics=first.metrics,
            metadata=first.metadata,
            parent=RefOut(run=first.parent.run, step=first.parent.step) if first.parent else None,
            children=[RefOut(run=name, step=step) for name, step in children],
            created_at=plan.created_at,
            durable_at=None,
            error=None,
            total_bytes=sum(r.scanned.total_bytes for r in added),
            file_count=sum(len(r.scanned.files) for r in added),
            write_seconds=first.write_seconds,
            shards=[
                ShardOut(
                    rank=r.request.rank,
                    node=node,
                    path=str(r.scanned.directory),
                    state=ShardState.REGISTERED,
                    error=None,
                )
                for r in added
            ],
            replicas=[
                ReplicaOut(
                    region=region,
                    state=ReplicaState.PENDING,
                    uri=store.uri(layout.step_prefix(plan.run, plan.key[1])),
                    verified_at=None,
                    committed_at=None,
                    error=None,
                )
                for region, store in self.r.stores.items()
            ],
        )


def batcher_for(resources: Resources) -> RegistrationBatcher:
    """The agent's writer, made on first use (one per Resources)."""
    if resources.registrations is None:
        resources.registrations = RegistrationBatcher(resources)
    return resources.registrations
