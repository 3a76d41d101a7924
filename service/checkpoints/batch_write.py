"""What one batch of registrations writes: its statements, built once, and
the set-based plan that runs them in one transaction.

The registration writer (batching.py) decides when a batch is written and
what happens when it fails; this module decides what is written. Every
refusal the catalog decides (409) is decided for a registration before any
of its rows is written (``decide``), so a refused registration leaves the
rest of its batch intact. A row another agent inserted first
(``ON CONFLICT DO NOTHING`` returning fewer rows) raises ``Raced``: the
writer rolls the transaction back and writes the batch again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from ..errors import ApiError, Conflict
from ..jobs import kinds, queue
from ..models import (
    ENDED_STATES,
    PRIORITY,
    CheckpointState,
    JobState,
    ReplicaState,
    ShardState,
    utcnow,
)
from ..resources import Resources
from ..storage import layout
from . import fresh_batch
from .batch_plan import Outcome, Planned, Raced, Registration, checkpoint_row
from .presenter import Listing, NewCheckpoint, NewShard, checkpoint_out
from .repository import ReplicaRow
from .schemas import CheckpointOut
from .tables import CHECKPOINTS, FILES, JOBS, REPLICAS, RUNS, SHARDS


def _expanding(name: str) -> Any:
    return bindparam(name, expanding=True)


# Every statement of a batch, built once: built per batch, their
# construction and cache keys are a visible share of the writer's CPU when
# batches are small. IN lists are expanding parameters, so the compiled SQL
# is cached and only the list is filled in per execution.
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


def _run_ids_of(
    conn: Connection, inserts: _Inserts, names: set[str], now: Any, cache: dict[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """(id of every run named, the ones not cached before)."""
    known = {name: cache[name] for name in names if name in cache}
    missing = sorted(names - known.keys())
    fetched: dict[str, int] = {}
    if missing:
        conn.execute(inserts.runs, [{"name": name, "created_at": now} for name in missing])
        rows = conn.execute(_RUN_IDS, {"names": missing})
        fetched = {name: run_id for name, run_id in rows}
    return {**known, **fetched}, fetched


def write_batch(
    conn: Connection,
    items: list[Registration],
    resources: Resources,
    known_runs: dict[str, int],
    assume_new: bool = False,
) -> tuple[list[Outcome | BaseException], dict[str, int]]:
    """The batch in the open transaction of ``conn``. ``assume_new``
    (PostgreSQL, ``conn`` in autocommit, every run known, no parent in the
    batch: ``batch_plan.one_statement_may_do``): every checkpoint is taken
    to be new, written in one statement (fresh_batch.py), ``NotAllNew``
    raised if one was not."""
    settings = resources.settings
    node = settings.server.node
    is_pg = conn.dialect.name == "postgresql"
    inserts = _INSERTS[conn.dialect.name]
    now = utcnow()

    names_wanted = {i.request.run for i in items}
    run_ids, new_runs = _run_ids_of(conn, inserts, names_wanted, now, known_runs)
    keys = sorted({(run_ids[i.request.run], i.request.step) for i in items})

    plans: dict[tuple[int, int], Planned] = {}
    names = {run_id: name for name, run_id in run_ids.items()}
    wanted = set(keys)
    existing = (
        ()
        if assume_new
        else conn.execute(
            _EXISTING_LOCKED if is_pg else _EXISTING,
            {
                "run_ids": sorted({run_id for run_id, _ in keys}),
                "steps": sorted({step for _, step in keys}),
            },
        )
    )
    for row in existing:
        key = (row.run_id, row.step)
        if key not in wanted:
            continue
        plans[key] = Planned(
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
    idempotent: list[tuple[int, Planned]] = []
    for index, item in enumerate(items):
        request = item.request
        key = (run_ids[request.run], request.step)
        plan = plans.get(key)
        if plan is None:
            # Registered when it was accepted: an inbox record is written
            # here moments (or, after an outage, long) later.
            plan = plans[key] = Planned.creating(key, request.run, request, item.accepted_at or now)
        try:
            decide(plan, index, item)
        except ApiError as exc:
            results[index] = exc
            continue
        if plan.added and plan.added[-1][0] == index:
            continue
        idempotent.append((index, plan))

    # Build the answers. A checkpoint created by this batch is answered
    # from what was written; anything older is read back by the caller.
    if assume_new:
        children = fresh_batch.write_new(resources, conn, plans, now, node)
    else:
        _insert(resources, conn, inserts, plans, now, node)
        children = _children(conn, [p for p in plans.values() if p.new and p.added])
    records: dict[tuple[int, int], CheckpointOut] = {}
    for plan in plans.values():
        if plan.new and plan.added:
            children_of = children.get((plan.run, plan.key[1]), [])
            records[plan.key] = answer_of_new(resources, plan, children_of)
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


def decide(plan: Planned, index: int, item: Registration) -> None:
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
    if plan.state in ENDED_STATES:
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
    resources: Resources,
    conn: Connection,
    inserts: _Inserts,
    plans: dict[tuple[int, int], Planned],
    now: Any,
    node: str,
) -> None:
    settings = resources.settings
    ordered = [plans[key] for key in sorted(plans)]
    new = [p for p in ordered if p.new and p.added]
    if new:
        rows = []
        for plan in new:
            rows.append({**checkpoint_row(plan), "updated_at": now, "pinned": False})
        inserted = conn.execute(inserts.checkpoints, rows)
        for checkpoint_id, run_id, step in inserted:
            plans[(run_id, step)].id = checkpoint_id
        if any(p.id is None for p in new):
            raise Raced()
        replicas = [
            {
                "checkpoint_id": plan.id,
                "region": region,
                "state": ReplicaState.PENDING.value,
                "uri": store.uri(layout.step_prefix(plan.run, plan.key[1])),
                "created_at": now,
            }
            for plan in new
            for region, store in resources.stores.items()
        ]
        if replicas:
            conn.execute(REPLICAS.insert(), replicas)

    adding = [(plan, reg) for plan in ordered for _, reg in plan.added]
    if not adding:
        _promote(conn, ordered)
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
        raise Raced()

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
            kinds.upload_row(
                plan.id,
                shard_id=shard_id,
                region=region,
                node=node,
                mode=kinds.UploadMode.PRIMARY,
                worker=settings.worker,
                priority=PRIORITY[reg.request.priority],
                now=now,
            )
        )
        if settings.peers.copies:
            jobs.append(
                kinds.peer_push_row(
                    plan.id,
                    shard_id=shard_id,
                    node=node,
                    priority=PRIORITY[reg.request.priority],
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
    _promote(conn, ordered)


def _promote(conn: Connection, ordered: Sequence[Planned]) -> None:
    promoted = [p.id for p in ordered if p.promote and p.id is not None]
    if not promoted:
        return
    conn.execute(_PROMOTE_CHECKPOINTS, {"ids": promoted, "now": utcnow()})
    conn.execute(_PROMOTE_JOBS, {"ids": promoted})


def _children(
    conn: Connection, plans: list[Planned]
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


def answer_of_new(
    resources: Resources, plan: Planned, children: list[tuple[str, int]]
) -> CheckpointOut:
    """The answer for a checkpoint ``plan`` creates, built from what is written
    (the inbox builds it the same way before the write: inbox.py)."""
    first = plan.first
    assert first is not None
    node = resources.settings.server.node
    added = sorted((reg for _, reg in plan.added), key=lambda r: r.request.rank)
    checkpoint = NewCheckpoint(
        step=plan.key[1],
        state=CheckpointState.REGISTERED,
        world_size=first.world_size,
        epoch=first.epoch,
        priority=plan.priority,
        metrics=first.metrics,
        meta=first.metadata,
        parent_run=first.parent.run if first.parent else None,
        parent_step=first.parent.step if first.parent else None,
        created_at=plan.created_at,
        total_bytes=sum(r.scanned.total_bytes for r in added),
        file_count=sum(len(r.scanned.files) for r in added),
        write_seconds=first.write_seconds,
    )
    listing = Listing(
        shards=[
            NewShard(r.request.rank, node, str(r.scanned.directory), ShardState.REGISTERED)
            for r in added
        ],
        replicas=[
            ReplicaRow(
                region=region,
                state=ReplicaState.PENDING,
                uri=store.uri(layout.step_prefix(plan.run, plan.key[1])),
                verified_at=None,
                committed_at=None,
                error=None,
            )
            for region, store in resources.stores.items()
        ],
        children=children,
        regions=list(resources.stores),
    )
    return checkpoint_out(plan.run, checkpoint, listing)
