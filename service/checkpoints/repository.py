"""Catalog queries about checkpoints (no HTTP, no storage)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import (
    JSON,
    ColumnElement,
    Connection,
    Select,
    String,
    bindparam,
    cast,
    func,
    select,
    true,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.elements import BindParameter

from ..db import dialect_name
from ..models import (
    VALID_STATES,
    Checkpoint,
    File,
    Job,
    PeerCopy,
    Replica,
    ReplicaState,
    Run,
    Shard,
)


async def get_or_create_run(session: AsyncSession, name: str) -> Run:
    dialect = postgresql if dialect_name(session) == "postgresql" else sqlite
    await session.execute(
        dialect.insert(Run).values(name=name).on_conflict_do_nothing(index_elements=["name"])
    )
    return (await session.scalars(select(Run).where(Run.name == name))).one()


async def find_run(session: AsyncSession, name: str) -> Run | None:
    return await session.scalar(select(Run).where(Run.name == name))


async def find_checkpoint(
    session: AsyncSession, run_id: int, step: int, *, for_update: bool = False
) -> Checkpoint | None:
    statement = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)
    if for_update:
        statement = statement.with_for_update()
    return await session.scalar(statement)


def _shards(checkpoint_ids: Sequence[int]) -> Select[Shard]:
    return select(Shard).where(Shard.checkpoint_id.in_(checkpoint_ids)).order_by(Shard.rank)


def _replicas(checkpoint_ids: Sequence[int]) -> Select[Replica]:
    return select(Replica).where(Replica.checkpoint_id.in_(checkpoint_ids)).order_by(Replica.id)


async def shards_of(session: AsyncSession, checkpoint_ids: Sequence[int]) -> list[Shard]:
    if not checkpoint_ids:
        return []
    return list(await session.scalars(_shards(checkpoint_ids)))


async def replicas_of(session: AsyncSession, checkpoint_ids: Sequence[int]) -> list[Replica]:
    if not checkpoint_ids:
        return []
    return list(await session.scalars(_replicas(checkpoint_ids)))


async def files_of(session: AsyncSession, checkpoint_id: int) -> list[tuple[int, File]]:
    rows = await session.execute(
        select(Shard.rank, File)
        .join(File, File.shard_id == Shard.id)
        .where(Shard.checkpoint_id == checkpoint_id)
        .order_by(Shard.rank, File.path)
    )
    return [(rank, file) for rank, file in rows]


# A file with its shard's rank, by the names the answers read (presenter.py).
FILE_COLUMNS = (
    Shard.rank,
    File.path.label("file_path"),
    File.size.label("file_size"),
    File.sha256.label("file_sha256"),
)
# A row of FILE_COLUMNS (or of _SHARD_FILE_COLUMNS), read by attribute.
FileRow = Any


def _file_rows(checkpoint_id: int | BindParameter[int]) -> Select[int, str, int, str | None]:
    return (
        select(*FILE_COLUMNS)
        .join(File, File.shard_id == Shard.id)
        .where(Shard.checkpoint_id == checkpoint_id)
        .order_by(Shard.rank, File.path)
    )


async def file_rows(session: AsyncSession, checkpoint_id: int) -> Sequence[FileRow]:
    """The checkpoint's files as FILE_COLUMNS rows, by rank then path."""
    return (await session.execute(_file_rows(checkpoint_id))).all()


async def chunk_hashes(
    session: AsyncSession, checkpoint_id: int
) -> dict[tuple[int, str], tuple[int, str]]:
    """(rank, path) -> (chunk_size, concatenated chunk SHA-256s) of the
    checkpoint's files that have them (storage/chunks.py)."""
    rows = await session.execute(
        select(Shard.rank, File.path, File.chunk_size, File.chunk_sha256)
        .join(File, File.shard_id == Shard.id)
        .where(
            Shard.checkpoint_id == checkpoint_id,
            File.chunk_size.is_not(None),
            File.chunk_sha256.is_not(None),
        )
    )
    return {
        (rank, path): (size, joined)
        for rank, path, size, joined in rows
        if size is not None and joined is not None
    }


async def children_of(session: AsyncSession, run: str, step: int) -> list[tuple[str, int]]:
    rows = await session.execute(CHILDREN, {"run": run, "step": step})
    return [(name, child_step) for name, child_step in rows]


async def latest_valid(
    session: AsyncSession, run_id: int, min_regions: int, region: str | None = None
) -> Checkpoint | None:
    """The valid checkpoint with the highest step (ties: newest).

    The state says every shard arrived and enough regions committed; the
    replica count is checked again here so a replica marked corrupt since
    can never make an invalid checkpoint the answer.
    """
    return await session.scalar(
        _latest_valid_statement(Checkpoint.run_id == run_id, min_regions, region)
    )


def _latest_valid_statement(
    of_run: ColumnElement[bool],
    min_regions: int | ColumnElement[int],
    region: str | ColumnElement[str] | None,
    columns: Sequence[Any] = (Checkpoint,),
) -> Select[Any]:  # Select[Checkpoint] on SQLAlchemy 2.1, Select[tuple[...]] on 2.0
    # Plan (both databases, checked with EXPLAIN at 100,000 checkpoints): walk
    # the (run_id, step) unique index backwards from the highest step and stop
    # at the first row passing the filters, each replica test an index probe
    # on (checkpoint_id[, region]). `step` is unique within a run, so the
    # created_at tie-break never reorders anything.
    good = (
        select(func.count())
        .select_from(Replica)
        .where(Replica.checkpoint_id == Checkpoint.id, Replica.state == ReplicaState.COMMITTED)
        .correlate(Checkpoint)
        .scalar_subquery()
    )
    statement = (
        select(*columns)
        .where(
            of_run,
            Checkpoint.state.in_(VALID_STATES),
            Checkpoint.quarantined_at.is_(None),
            good >= min_regions,
        )
        .order_by(Checkpoint.step.desc(), Checkpoint.created_at.desc())
        .limit(1)
    )
    if region is not None:
        in_region = (
            select(Replica.id)
            .where(
                Replica.checkpoint_id == Checkpoint.id,
                Replica.region == region,
                Replica.state == ReplicaState.COMMITTED,
            )
            .correlate(Checkpoint)
            .exists()
        )
        statement = statement.where(in_region)
    return statement


# -- latest: the hot read -----------------------------------------------------
# Built once, with bound parameters, selecting columns rather than entities:
# profiled at 100,000 checkpoints, building the statements on every call (and
# their cache keys) and loading ORM entities cost as much CPU as everything
# else in a `latest` answer. One statement on PostgreSQL, two on SQLite: on
# PostgreSQL every statement is a round trip and a wake-up of the server, most
# of a read's latency. Rows come back as named tuples whose attributes are the
# ORM's names (checkpoint metadata is labelled `meta`).
CHECKPOINT_COLUMNS = [
    column.label("meta") if column.key == "metadata" else column
    for column in Checkpoint.__table__.c
]
_RUN_ID = select(Run.id).where(Run.name == bindparam("run")).scalar_subquery()
# Run names are [A-Za-z0-9._-] (names.py), so "name:step" joined by "," is
# parsed back unambiguously: the children ride along in one column.
CHILD_SEPARATOR, CHILD_STEP_SEPARATOR = ",", ":"


# A shard with one of its files (file columns null for a shard without any).
_SHARD_FILE_COLUMNS = (
    Shard.id,
    Shard.rank,
    Shard.node,
    Shard.path,
    Shard.state,
    Shard.error,
    File.path.label("file_path"),
    File.size.label("file_size"),
    File.mtime_ns.label("file_mtime_ns"),
    File.sha256.label("file_sha256"),
)


class ShardFileRow(NamedTuple):
    """One element of the PostgreSQL statement's `contents` column, by the
    same names as the rows of SHARDS_WITH_FILES (the SQLite path)."""

    id: int
    rank: int
    node: str | None
    path: str
    state: str
    error: str | None
    file_path: str | None
    file_size: int | None
    file_mtime_ns: int | None
    file_sha256: str | None


def joined_children(step: Any) -> Any:
    """The checkpoints naming ``:run``'s ``step`` as their parent, as one
    "name:step,..." string (parse_children reads it back)."""
    child, child_run = aliased(Checkpoint), aliased(Run)
    return (
        select(
            func.aggregate_strings(
                child_run.name + CHILD_STEP_SEPARATOR + cast(child.step, String), CHILD_SEPARATOR
            )
        )
        .select_from(child)
        .join(child_run, child_run.id == child.run_id)
        .where(child.parent_run == bindparam("run"), child.parent_step == step)
        .scalar_subquery()
    )


def _latest_statement(with_region: bool, with_contents: bool = False) -> Select[Any]:
    """The latest valid checkpoint (one row per replica, or one with null
    replica columns) and its children as one "name:step,..." string.

    ``with_contents`` (PostgreSQL only): plus a `contents` column, the shards
    and their files as one JSON array of ShardFileRow-shaped arrays (by rank,
    then path), aggregated once per answer in a lateral subquery. One
    statement instead of two, since every statement through asyncpg is a
    round trip, a wake-up of the server and a share of driver and SQLAlchemy
    work of its own. SQLite keeps two statements: it runs in process (no
    round trip), and its aggregates take no ORDER BY before 3.44."""
    latest = _latest_valid_statement(
        Checkpoint.run_id == _RUN_ID,
        bindparam("min_regions"),
        bindparam("region") if with_region else None,
        CHECKPOINT_COLUMNS,
    ).subquery("latest")
    columns: list[Any] = [
        latest,
        joined_children(latest.c.step).label("children"),
        *(column.label(f"replica_{column.key}") for column in Replica.__table__.c),
    ]
    source: Any = latest
    if with_contents:
        contents = (
            select(
                func.json_agg(
                    postgresql.aggregate_order_by(
                        func.json_build_array(*_SHARD_FILE_COLUMNS), Shard.rank, File.path
                    ),
                    type_=JSON,
                ).label("contents")
            )
            .select_from(Shard)
            .outerjoin(File, File.shard_id == Shard.id)
            .where(Shard.checkpoint_id == latest.c.id)
            .lateral("contents")
        )
        columns.append(contents.c.contents)
        source = latest.join(contents, true())
    return (
        select(*columns)
        .select_from(source.outerjoin(Replica, Replica.checkpoint_id == latest.c.id))
        .order_by(Replica.id)
    )


LATEST_STATEMENTS: dict[bool, Select[Any]] = {
    with_region: _latest_statement(with_region) for with_region in (False, True)
}
LATEST_WITH_CONTENTS: dict[bool, Select[Any]] = {
    with_region: _latest_statement(with_region, with_contents=True) for with_region in (False, True)
}
SHARDS_WITH_FILES = (
    select(*_SHARD_FILE_COLUMNS)
    .outerjoin(File, File.shard_id == Shard.id)
    .where(Shard.checkpoint_id == bindparam("checkpoint_id"))
    .order_by(Shard.rank, File.path)
)
CHILDREN = (
    select(Run.name, Checkpoint.step)
    .join(Run, Run.id == Checkpoint.run_id)
    .where(Checkpoint.parent_run == bindparam("run"), Checkpoint.parent_step == bindparam("step"))
    .order_by(Run.name, Checkpoint.step)
)


# A sqlalchemy Row, read by attribute (its columns' labels). Its precise
# generic type differs between SQLAlchemy 2.0 and 2.1 and adds nothing here.
CatalogRow = Any


@dataclass(frozen=True)
class ReplicaRow:
    region: str
    state: str
    uri: str
    verified_at: datetime | None
    committed_at: datetime | None
    error: str | None


@dataclass
class LatestRows:
    """Everything `latest` answers with, read in one transaction, as rows
    (attribute access by the ORM's names; see the statements above)."""

    checkpoint: CatalogRow
    shards: list[CatalogRow]
    # (rank, path, size, mtime_ns, sha256) of every file, by rank then path.
    files: list[CatalogRow]
    replicas: list[ReplicaRow]
    children: list[tuple[str, int]]


def parse_children(joined: str | None) -> list[tuple[str, int]]:
    """The children column's "name:step,..." back as (run, step) pairs."""
    if not joined:
        return []
    out = []
    for child in joined.split(CHILD_SEPARATOR):
        name, _, step = child.rpartition(CHILD_STEP_SEPARATOR)
        out.append((name, int(step)))
    return sorted(out)


def latest_rows(
    connection: Connection, run: str, min_regions: int, region: str | None
) -> LatestRows | None:
    """The latest valid checkpoint of ``run`` and its shards, files, replicas
    and children: one statement on PostgreSQL, two on SQLite (see
    _latest_statement), written against a plain (sync) Connection so the
    whole read runs at once where row_reads.py puts it (on SQLite the event
    loop), not a turn of the loop per statement."""
    one_statement = connection.dialect.name == "postgresql"
    statements = LATEST_WITH_CONTENTS if one_statement else LATEST_STATEMENTS
    rows = connection.execute(
        statements[region is not None],
        {"run": run, "min_regions": min_regions, "region": region},
    ).all()
    if not rows:
        return None
    checkpoint = rows[0]
    replicas = [
        ReplicaRow(
            region=r.replica_region,
            state=r.replica_state,
            uri=r.replica_uri,
            verified_at=r.replica_verified_at,
            committed_at=r.replica_committed_at,
            error=r.replica_error,
        )
        for r in rows
        if r.replica_id is not None
    ]
    contents: Sequence[CatalogRow]
    if one_statement:
        # `or ()`: json_agg over no rows is null (a checkpoint has shards, though).
        contents = [ShardFileRow(*item) for item in checkpoint.contents or ()]
    else:
        contents = connection.execute(SHARDS_WITH_FILES, {"checkpoint_id": checkpoint.id}).all()
    shards: dict[int, CatalogRow] = {}
    files: list[CatalogRow] = []
    for row in contents:
        shards.setdefault(row.id, row)
        if row.file_path is not None:
            files.append(row)
    return LatestRows(
        checkpoint, list(shards.values()), files, replicas, parse_children(checkpoint.children)
    )


async def list_checkpoints(
    session: AsyncSession,
    run_id: int,
    *,
    states: Sequence[str] | None,
    min_step: int | None,
    max_step: int | None,
    limit: int,
    offset: int,
    pinned: bool | None = None,
) -> tuple[list[Checkpoint], int]:
    conditions = [Checkpoint.run_id == run_id]
    if pinned is not None:
        conditions.append(Checkpoint.pinned.is_(pinned))
    if states:
        conditions.append(Checkpoint.state.in_(states))
    if min_step is not None:
        conditions.append(Checkpoint.step >= min_step)
    if max_step is not None:
        conditions.append(Checkpoint.step <= max_step)
    total = await session.scalar(select(func.count()).select_from(Checkpoint).where(*conditions))
    page = await session.scalars(
        select(Checkpoint)
        .where(*conditions)
        .order_by(Checkpoint.step.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(page), int(total or 0)


async def list_runs(
    session: AsyncSession, limit: int, offset: int
) -> tuple[list[tuple[Run, int, int | None]], int]:
    total = await session.scalar(select(func.count()).select_from(Run))
    rows = await session.execute(
        select(Run, func.count(Checkpoint.id), func.max(Checkpoint.step))
        .outerjoin(Checkpoint, Checkpoint.run_id == Run.id)
        .group_by(Run.id)
        .order_by(Run.name)
        .limit(limit)
        .offset(offset)
    )
    return [(run, count, top) for run, count, top in rows], int(total or 0)


def _jobs(checkpoint_id: int | BindParameter[int]) -> Select[Job, int]:
    return (
        select(Job, Shard.rank)
        .outerjoin(Shard, Shard.id == Job.shard_id)
        .where(Job.checkpoint_id == checkpoint_id)
        .order_by(Job.id)
    )


async def jobs_of(session: AsyncSession, checkpoint_id: int) -> list[tuple[Job, int | None]]:
    return [(job, rank) for job, rank in await session.execute(_jobs(checkpoint_id))]


@dataclass(frozen=True)
class DetailRows:
    """What a checkpoint's detail view lists, read in one snapshot: ORM
    objects (detail_rows), or rows by the same attribute names
    (detail_in_one.py, PostgreSQL)."""

    checkpoint: Checkpoint | CatalogRow
    shards: Sequence[Shard | CatalogRow]
    replicas: Sequence[Replica | ReplicaRow]
    children: list[tuple[str, int]]
    files: Sequence[FileRow]
    jobs: Sequence[tuple[Job | CatalogRow, int | None]]
    peer_copies: Sequence[PeerCopy | CatalogRow]


# The detail's statements, built once: each poll of a checkpoint's detail
# then only binds its values (building a statement and its cache key took
# about as long as running it).
_DETAIL_CHECKPOINT = (
    select(Checkpoint)
    .join(Run, Run.id == Checkpoint.run_id)
    .where(Run.name == bindparam("run"), Checkpoint.step == bindparam("step"))
)
_DETAIL_SHARDS = select(Shard).where(Shard.checkpoint_id == bindparam("id")).order_by(Shard.rank)
_DETAIL_REPLICAS = (
    select(Replica).where(Replica.checkpoint_id == bindparam("id")).order_by(Replica.id)
)
_DETAIL_FILES = _file_rows(bindparam("id"))
_DETAIL_JOBS = _jobs(bindparam("id"))
_DETAIL_PEER_COPIES = (
    select(PeerCopy)
    .where(PeerCopy.checkpoint_id == bindparam("id"))
    .order_by(PeerCopy.node, PeerCopy.shard_id)
)


def detail_rows(session: Session, run: str, step: int) -> DetailRows | None:
    """The checkpoint ``run``/``step`` and its rows (None: there is none),
    written against a plain (sync) Session like latest_rows: on SQLite the
    whole read runs on the event loop (db.read_snapshot), not a turn of it
    per statement. The detail is what callers poll while they wait for a
    checkpoint, so it runs often beside registrations; the peer copies are
    read in the same snapshot. PostgreSQL reads the same rows in one
    statement instead (detail_in_one.py)."""
    checkpoint = session.scalar(_DETAIL_CHECKPOINT, {"run": run, "step": step})
    if checkpoint is None:
        return None
    by_id = {"id": checkpoint.id}
    return DetailRows(
        checkpoint=checkpoint,
        shards=list(session.scalars(_DETAIL_SHARDS, by_id)),
        replicas=list(session.scalars(_DETAIL_REPLICAS, by_id)),
        children=[
            (name, child) for name, child in session.execute(CHILDREN, {"run": run, "step": step})
        ],
        files=session.execute(_DETAIL_FILES, by_id).all(),
        jobs=[(job, rank) for job, rank in session.execute(_DETAIL_JOBS, by_id)],
        peer_copies=list(session.scalars(_DETAIL_PEER_COPIES, by_id)),
    )


async def last_durable_by_region(
    session: AsyncSession, min_regions: int, run_ids: Sequence[int] | None = None
) -> list[tuple[str, str, Checkpoint]]:
    """(run, region, checkpoint) for the valid checkpoint with the highest step
    that is committed in that region: where each run restarts from, per region.
    The same rule as ``latest_valid``, for every run and region in one query."""
    other = aliased(Replica)
    good = (
        select(func.count())
        .select_from(other)
        .where(other.checkpoint_id == Checkpoint.id, other.state == ReplicaState.COMMITTED)
        .correlate(Checkpoint)
        .scalar_subquery()
    )
    conditions = [
        Checkpoint.state.in_(VALID_STATES),
        Checkpoint.quarantined_at.is_(None),
        Replica.state == ReplicaState.COMMITTED,
        good >= min_regions,
    ]
    if run_ids is not None:
        conditions.append(Checkpoint.run_id.in_(run_ids))
    best = (
        select(
            Checkpoint.run_id.label("run_id"),
            Replica.region.label("region"),
            func.max(Checkpoint.step).label("step"),
        )
        .join(Replica, Replica.checkpoint_id == Checkpoint.id)
        .where(*conditions)
        .group_by(Checkpoint.run_id, Replica.region)
        .subquery()
    )
    rows = await session.execute(
        select(Run.name, best.c.region, Checkpoint)
        .select_from(best)
        .join(Checkpoint, (Checkpoint.run_id == best.c.run_id) & (Checkpoint.step == best.c.step))
        .join(Run, Run.id == best.c.run_id)
        .order_by(Run.name, best.c.region)
    )
    return [(name, region, checkpoint) for name, region, checkpoint in rows]
