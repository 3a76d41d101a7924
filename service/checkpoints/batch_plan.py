"""A batch of registrations as the writer plans it: each registration, its
answer, and each checkpoint as the batch sees it (existing or about to be
created), shared by both ways of writing it (batch_write.py, fresh_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..models import CheckpointState
from .register_timing import BatchTiming
from .scan import ScannedShard
from .schemas import CheckpointOut, RegisterRequest


@dataclass(frozen=True)
class Registration:
    """One validated registration: the request and what the scan found."""

    request: RegisterRequest
    scanned: ScannedShard
    hashes: dict[str, str]
    fingerprint: str
    # When the agent accepted it, if before its write (an inbox record,
    # inbox.py): the checkpoint's created_at; None: the batch's time.
    accepted_at: datetime | None = None


@dataclass(frozen=True)
class Outcome:
    created: bool
    # Built from what was written when the whole checkpoint is from this
    # batch; None when the caller must read it back (it existed before).
    record: CheckpointOut | None
    # Where the registration's time in the writer went (batching.py).
    timing: BatchTiming | None = None


class Raced(Exception):
    """Another agent inserted a row this batch meant to insert."""


@dataclass
class Planned:
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

    @classmethod
    def creating(
        cls, key: tuple[int, int], run: str, first: RegisterRequest, created_at: Any
    ) -> Planned:
        """A checkpoint not in the catalog yet, created by ``first``."""
        return cls(
            key=key,
            run=run,
            id=None,
            new=True,
            world_size=first.world_size,
            state=CheckpointState.REGISTERED,
            priority=first.priority,
            error=None,
            first=first,
            created_at=created_at,
        )


def one_statement_may_do(items: list[Registration], known_runs: dict[str, int]) -> bool:
    """Whether a batch may be written in one statement (fresh_batch.py):
    every run is known (a new run's row comes first, in a transaction), and
    no checkpoint of the batch names another as its parent (the statement
    reads children in its snapshot, which would miss them)."""
    steps = {(i.request.run, i.request.step) for i in items}
    return all(i.request.run in known_runs for i in items) and not any(
        (i.request.parent.run, i.request.parent.step) in steps
        for i in items
        if i.request.parent is not None
    )


def checkpoint_row(plan: Planned) -> dict[str, Any]:
    """A new checkpoint's columns (either way of writing it; the times are
    the statement's)."""
    first = plan.first
    assert first is not None
    return {
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
        "created_at": plan.created_at,
    }
