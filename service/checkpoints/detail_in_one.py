"""PostgreSQL: a checkpoint's detail view read in one statement.

The detail (``GET /v1/runs/{run}/checkpoints/{step}``) is what a caller
polls while it waits for its checkpoint (``client.wait``, a save with
``wait_durable``, the CLI's ``wait``, dashboards). Read through an ORM
session it is a transaction of seven statements (the checkpoint, its
shards, replicas, children, files, jobs and peer copies): on PostgreSQL
nine round trips with BEGIN and COMMIT, each a wake-up of a server backend
and a turn of the agent's event loop, and each poll of it meets the
registrations and `latest` answers on the same node's CPUs.

Here the same rows come back in one statement, run in autocommit on the read
pool (row_reads.py), so it is its own snapshot, as the transaction was: the
checkpoint's columns, then each list as one JSON array (``json_agg`` of
``json_build_array``, in the order the ORM statements give), parsed back
into plain rows by the ORM's attribute names, which is what the presenter
and the peer view read (presenter.py). Timestamps come back from JSON as ISO
strings and are turned back into datetimes. SQLite keeps the session read
(``repository.detail_rows``): it runs in process on the event loop, where a
statement costs no round trip, and its aggregates take no ORDER BY before
3.44. A test holds the two reads' answers together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import JSON, Connection, Select, bindparam, func, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import aliased, join, outerjoin

from ..models import Checkpoint, File, Job, PeerCopy, Replica, Run, Shard
from .repository import (
    CHECKPOINT_COLUMNS,
    DetailRows,
    ReplicaRow,
    joined_children,
    parse_children,
)


class ShardRow(NamedTuple):
    id: int
    rank: int
    node: str
    path: str
    state: str
    error: str | None
    evicted_at: datetime | None


class FileListRow(NamedTuple):
    """By the names of repository.FILE_COLUMNS."""

    rank: int
    file_path: str
    file_size: int
    file_sha256: str | None


class JobRow(NamedTuple):
    kind: str
    state: str
    region: str | None
    attempts: int
    last_error: str | None


class PeerCopyRow(NamedTuple):
    shard_id: int
    node: str
    path: str
    state: str
    committed_at: datetime | None
    verified_at: datetime | None


def _when(value: str | None) -> datetime | None:
    # PostgreSQL's JSON of a timestamp without time zone: ISO 8601, naive,
    # as the ORM reads the column.
    return None if value is None else datetime.fromisoformat(value)


def _listed(columns: Sequence[Any], order_by: Sequence[Any], where: Any, source: Any) -> Any:
    """``columns`` of each row of ``source`` that matches ``where``, as one
    JSON array of arrays in ``order_by`` order; ``[]`` for none."""
    return (
        select(
            func.coalesce(
                func.json_agg(
                    postgresql.aggregate_order_by(func.json_build_array(*columns), *order_by),
                    type_=JSON,
                ),
                func.json_build_array(),  # []
                type_=JSON,
            )
        )
        .select_from(source)
        .where(where)
        .scalar_subquery()
    )


def _statement() -> Select[Any]:
    checkpoint = (
        select(*CHECKPOINT_COLUMNS)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == bindparam("run"), Checkpoint.step == bindparam("step"))
        .subquery("checkpoint")
    )
    of_it = checkpoint.c.id
    shards = _listed(
        (Shard.id, Shard.rank, Shard.node, Shard.path, Shard.state, Shard.error, Shard.evicted_at),
        (Shard.rank,),
        Shard.checkpoint_id == of_it,
        Shard,
    )
    replicas = _listed(
        (
            Replica.region,
            Replica.state,
            Replica.uri,
            Replica.verified_at,
            Replica.committed_at,
            Replica.error,
        ),
        (Replica.id,),
        Replica.checkpoint_id == of_it,
        Replica,
    )
    file_shard = aliased(Shard)
    files = _listed(
        (file_shard.rank, File.path, File.size, File.sha256),
        (file_shard.rank, File.path),
        file_shard.checkpoint_id == of_it,
        join(File, file_shard, file_shard.id == File.shard_id),
    )
    job_shard = aliased(Shard)
    jobs = _listed(
        (Job.kind, Job.state, Job.region, Job.attempts, Job.last_error, job_shard.rank),
        (Job.id,),
        Job.checkpoint_id == of_it,
        outerjoin(Job, job_shard, job_shard.id == Job.shard_id),
    )
    peer_copies = _listed(
        (
            PeerCopy.shard_id,
            PeerCopy.node,
            PeerCopy.path,
            PeerCopy.state,
            PeerCopy.committed_at,
            PeerCopy.verified_at,
        ),
        (PeerCopy.node, PeerCopy.shard_id),
        PeerCopy.checkpoint_id == of_it,
        PeerCopy,
    )
    return select(
        checkpoint,
        shards.label("shard_list"),
        replicas.label("replica_list"),
        files.label("file_list"),
        jobs.label("job_list"),
        peer_copies.label("peer_copy_list"),
        joined_children(checkpoint.c.step).label("children"),
    )


STATEMENT = _statement()


def _rows(items: list[list[Any]], make: Callable[..., Any], *timestamps: int) -> list[Any]:
    out = []
    for item in items:
        for index in timestamps:
            item[index] = _when(item[index])
        out.append(make(*item))
    return out


def detail_rows(connection: Connection, run: str, step: int) -> DetailRows | None:
    """repository.detail_rows' answer, read in one statement (PostgreSQL)."""
    row = connection.execute(STATEMENT, {"run": run, "step": step}).first()
    if row is None:
        return None
    jobs = [(JobRow(*item[:5]), item[5]) for item in row.job_list]
    return DetailRows(
        checkpoint=row,
        shards=_rows(row.shard_list, ShardRow, 6),
        replicas=_rows(row.replica_list, ReplicaRow, 3, 4),
        children=parse_children(row.children),
        files=_rows(row.file_list, FileListRow),
        jobs=jobs,
        peer_copies=_rows(row.peer_copy_list, PeerCopyRow, 4, 5),
    )
