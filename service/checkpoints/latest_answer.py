"""The `latest` answer, read and written as JSON straight from the catalog's rows.

`latest` is asked on every restart and by orchestrators polling. Its read is
two statements in one hop to a database thread on SQLite (or one greenlet
run on PostgreSQL), and its answer is written here as a plain dict and
serialized once, without building the response models (about a tenth of its
CPU). The shape is the documented `LatestOut` (schemas.py), field for field
and in its order; the tests hold the two together (each answer validates as a
LatestOut that serializes back to the same JSON, and equals the checkpoint's
detail view).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from ..errors import BadInput, NotFound
from ..models import ReplicaState
from ..resources import Resources
from . import repository as repo
from .repository import CatalogRow, LatestRows, ReplicaRow
from .schemas import _iso
from .state import replication_lag


def _replica(checkpoint: CatalogRow, replica: ReplicaRow) -> dict[str, Any]:
    return {
        "region": replica.region,
        "state": replica.state,
        "uri": replica.uri,
        "verified_at": _iso(replica.verified_at),
        "committed_at": _iso(replica.committed_at),
        "error": replica.error,
        "lag_seconds": replication_lag(checkpoint, replica),
    }


def latest_document(
    run: str, rows: LatestRows, regions: Sequence[str], local: dict[str, str] | None
) -> dict[str, Any]:
    c = rows.checkpoint
    order = {name: i for i, name in enumerate(regions)}
    replicas = sorted(rows.replicas, key=lambda r: order.get(r.region, len(order)))
    return {
        "run": run,
        "step": c.step,
        "state": c.state,
        "world_size": c.world_size,
        "epoch": c.epoch,
        "priority": c.priority,
        "metrics": {name: float(value) for name, value in (c.metrics or {}).items()},
        "metadata": c.meta or {},
        "parent": {"run": c.parent_run, "step": c.parent_step}
        if c.parent_run is not None and c.parent_step is not None
        else None,
        "children": [{"run": name, "step": step} for name, step in rows.children],
        "created_at": _iso(c.created_at),
        "durable_at": _iso(c.durable_at),
        "error": c.error,
        "total_bytes": c.total_bytes,
        "file_count": c.file_count,
        "write_seconds": None if c.write_seconds is None else float(c.write_seconds),
        "pinned": bool(c.pinned),
        "quarantined_at": _iso(c.quarantined_at),
        "quarantine_reason": c.quarantine_reason,
        "deleted_at": _iso(c.deleted_at),
        "deleted_reason": c.deleted_reason,
        "shards": [
            {"rank": s.rank, "node": s.node, "path": s.path, "state": s.state, "error": s.error}
            for s in rows.shards
        ],
        "files": [
            {"rank": f.rank, "path": f.file_path, "size": f.file_size, "sha256": f.file_sha256}
            for f in rows.files
        ],
        "replicas": [_replica(c, r) for r in replicas],
        "jobs": None,
        "locations": [
            {"region": r.region, "uri": r.uri}
            for r in replicas
            if r.state == ReplicaState.COMMITTED
        ],
        "local": local,
    }


def to_json(document: dict[str, Any]) -> bytes:
    # Compact and UTF-8, as pydantic writes the models.
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


T = TypeVar("T")


def _in_sync_session(maker: sessionmaker[Session], read: Callable[..., T], *args: Any) -> T:
    """Run ``read`` in one (read-only) transaction of a plain Session, in the
    calling thread."""
    with maker() as session, session.begin():
        return read(session, *args)


async def latest_json(
    resources: Resources, run: str, region: str | None, node: str | None
) -> bytes:
    """The latest valid checkpoint of ``run`` as the JSON of a LatestOut;
    BadInput for an unknown region, NotFound when none is valid yet."""
    if region is not None and region not in resources.stores:
        raise BadInput(
            f"unknown region {region!r}; configured: {', '.join(resources.stores)}",
            code="unknown_region",
        )
    rows = await read_latest_rows(
        resources.sync_readers,
        resources.read_sessionmaker or resources.sessionmaker,
        run,
        resources.settings.durability.min_regions,
        region,
    )
    if rows is None:
        where = f" in region {region}" if region else ""
        raise NotFound(
            f"run {run!r} has no valid checkpoint{where} yet", code="no_valid_checkpoint"
        )
    local = await _local_copy(resources, rows, node)
    return to_json(latest_document(run, rows, list(resources.stores), local))


async def read_latest_rows(
    readers: sessionmaker[Session] | None,
    maker: async_sessionmaker[AsyncSession],
    run: str,
    min_regions: int,
    region: str | None,
) -> LatestRows | None:
    """The catalog read behind `latest` (the benchmark times it alone too).

    SQLite (``readers``): through aiosqlite every statement costs several
    thread hand-offs (~46 per answer once, most of its CPU); the read runs
    whole in one hop on the agent's plain-sqlite read engine, in one
    snapshot. PostgreSQL: on ``maker``'s pool, once more after a disconnect."""
    if readers is not None:
        return await asyncio.to_thread(
            _in_sync_session, readers, repo.latest_rows, run, min_regions, region
        )
    return await _read_with_retry(maker, run, min_regions, region)


async def _read_with_retry(
    maker: async_sessionmaker[AsyncSession], run: str, min_regions: int, region: str | None
) -> LatestRows | None:
    """PostgreSQL: the read, once more on a connection that turned out dead
    (db._ping_when_idle hands out recently used ones without a ping; the
    failure invalidated the pool, so the second try gets a fresh one)."""
    for attempt in (1, 2):
        try:
            async with maker() as session:
                return await session.run_sync(repo.latest_rows, run, min_regions, region)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
    raise AssertionError("unreachable")


async def _local_copy(
    resources: Resources, rows: LatestRows, node: str | None
) -> dict[str, str] | None:
    """The T0 copy, only when this agent is that node and can check the
    files are still exactly what was uploaded (size and mtime)."""
    if node is None or node != resources.settings.server.node or rows.checkpoint.world_size != 1:
        return None
    shard = rows.shards[0]
    if shard.node != node:
        return None

    def intact() -> bool:
        for f in rows.files:
            try:
                info = os.stat(Path(shard.path) / f.file_path)
            except OSError:
                return False
            if info.st_size != f.file_size or info.st_mtime_ns != f.file_mtime_ns:
                return False
        return True

    if await asyncio.to_thread(intact):
        return {"node": node, "path": shard.path}
    return None
