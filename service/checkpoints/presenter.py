"""The checkpoint answers, each shape built in one place.

One builder per shape: `checkpoint_document` (the detail view, a list entry,
a registration's answer) and `latest_document` (`latest`: the same plus where
to restore from). Each builds a JSON-ready dict, field for field and in the
order of its response model (schemas.CheckpointOut, schemas.LatestOut), from
plain values read by the ORM's attribute names: the catalog's ORM objects,
the rows of the `latest` read, or a registration's values (NewCheckpoint,
NewShard, repository.ReplicaRow). So the hot path (`latest`, answered
without models, see latest_answer.py) pays for no model and no extra query,
and the other answers are the same dict validated as their model
(`checkpoint_out`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..models import Checkpoint, Job, Replica, ReplicaState, Shard
from .repository import DetailRows, FileRow, ReplicaRow
from .schemas import CheckpointOut, iso_timestamp
from .state import replication_lag


@dataclass(frozen=True, slots=True)
class NewCheckpoint:
    """A checkpoint just registered, before the catalog changed anything of it."""

    step: int
    state: str
    world_size: int
    epoch: int | None
    priority: str
    metrics: dict[str, float]
    meta: dict[str, Any]
    parent_run: str | None
    parent_step: int | None
    created_at: datetime
    total_bytes: int
    file_count: int
    write_seconds: float | None
    durable_at: datetime | None = None
    error: str | None = None
    pinned: bool = False
    quarantined_at: datetime | None = None
    quarantine_reason: str | None = None
    deleted_at: datetime | None = None
    deleted_reason: str | None = None


# A checkpoint by the ORM's attribute names: a catalog object, a row of the
# `latest` read (metadata labelled `meta`), or one just registered.
CheckpointValues = Checkpoint | NewCheckpoint


@dataclass(frozen=True, slots=True)
class NewShard:
    rank: int
    node: str
    path: str
    state: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Listing:
    """What a checkpoint's answer lists besides the checkpoint itself."""

    shards: Iterable[Shard | NewShard]
    replicas: Iterable[Replica | ReplicaRow]
    children: Iterable[tuple[str, int]] = ()
    # None: not part of this answer (list entries, registrations).
    files: Iterable[FileRow] | None = None
    jobs: Iterable[tuple[Job, int | None]] | None = None
    # Configured regions, in configuration order: the replicas' order.
    regions: Sequence[str] = field(default_factory=list)


def detail_listing(rows: DetailRows, regions: Sequence[str]) -> Listing:
    """What the detail view lists, from its read's rows (either read)."""
    return Listing(
        shards=rows.shards,
        replicas=rows.replicas,
        children=rows.children,
        files=rows.files,
        jobs=rows.jobs,
        regions=regions,
    )


def checkpoint_document(run: str, c: CheckpointValues, listing: Listing) -> dict[str, Any]:
    """A checkpoint as the JSON of a CheckpointOut."""
    order = {name: i for i, name in enumerate(listing.regions)}
    replicas = sorted(listing.replicas, key=lambda r: order.get(r.region, len(order)))
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
        "children": [{"run": name, "step": step} for name, step in listing.children],
        "created_at": iso_timestamp(c.created_at),
        "durable_at": iso_timestamp(c.durable_at),
        "error": c.error,
        "total_bytes": c.total_bytes,
        "file_count": c.file_count,
        "write_seconds": None if c.write_seconds is None else float(c.write_seconds),
        "pinned": bool(c.pinned),
        "quarantined_at": iso_timestamp(c.quarantined_at),
        "quarantine_reason": c.quarantine_reason,
        "deleted_at": iso_timestamp(c.deleted_at),
        "deleted_reason": c.deleted_reason,
        "shards": [
            {"rank": s.rank, "node": s.node, "path": s.path, "state": s.state, "error": s.error}
            for s in listing.shards
        ],
        "files": None
        if listing.files is None
        else [
            {"rank": f.rank, "path": f.file_path, "size": f.file_size, "sha256": f.file_sha256}
            for f in listing.files
        ],
        "replicas": [
            {
                "region": r.region,
                "state": r.state,
                "uri": r.uri,
                "verified_at": iso_timestamp(r.verified_at),
                "committed_at": iso_timestamp(r.committed_at),
                "error": r.error,
                "lag_seconds": replication_lag(c, r),
            }
            for r in replicas
        ],
        "jobs": None
        if listing.jobs is None
        else [
            {
                "kind": job.kind,
                "state": job.state,
                "region": job.region,
                "rank": rank,
                "attempts": job.attempts,
                "last_error": job.last_error,
            }
            for job, rank in listing.jobs
        ],
        "copies": None,
        "peers": None,
        "peer_safe": None,
    }


def latest_document(
    run: str, c: CheckpointValues, listing: Listing, local: dict[str, Any] | None
) -> dict[str, Any]:
    """The latest valid checkpoint as the JSON of a LatestOut: the checkpoint
    plus its committed copies and the T0 copy on the asking node, if any."""
    document = checkpoint_document(run, c, listing)
    document["locations"] = [
        {"region": r["region"], "uri": r["uri"]}
        for r in document["replicas"]
        if r["state"] == ReplicaState.COMMITTED
    ]
    document["local"] = local
    return document


def checkpoint_out(run: str, c: CheckpointValues, listing: Listing) -> CheckpointOut:
    """The checkpoint's document as its response model."""
    return CheckpointOut.model_validate(checkpoint_document(run, c, listing))


def to_json(document: dict[str, Any]) -> bytes:
    # Compact and UTF-8, as pydantic writes the models.
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
