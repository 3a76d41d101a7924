"""When a staged segment is written to T0, and whether at all.

The persister registers a staged segment at once, and the upload starts
reading it from memory. Written to T0 during that upload, the same
checkpoint's T0 copy takes disk, memory bandwidth and CPU time from the copy
that makes it durable. With ``[memory] t0_wait_seconds`` set, the T0 write
waits for the shard's upload to end (uploaded, or failed), for at most that
long, and not at all once a reservation finds the arena full: memory is
freed only when T0 holds the bytes. By default (0) it does not wait: on the
benchmark's machines waiting made no measurable difference to save →
durable, and the T0 copy came about a second after the save instead of
after the upload (benchmarks/README.md, "Issue 16 on a twenty-third
machine").

T0 eviction (`[local] keep_last`) may pass over such a checkpoint before
its T0 copy exists: once durable and beyond the newest kept, its shard is
marked evicted with nothing to delete. Its T0 copy is then not written (the
segment is freed), or removed right after if the mark came during the write.

What waiting risks: until T0 holds it, the checkpoint is in memory only. A
killed trainer or agent loses nothing (segments are files in a tmpfs that
outlive both); a node that reboots before the upload ends loses it, where
T0 written first might have kept it for a node whose disk survived. It was
not durable, so `latest` never named it; the run resumes from the one
before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.engine import Connection

from ..checkpoints.tables import CHECKPOINTS, RUNS, SHARDS
from ..models import ShardState as State

# A shard in these states is still on its way to the store.
UPLOADING = (State.REGISTERED.value, State.UPLOADING.value)

Shard = tuple[str, int, int]  # run, step, rank

_STATES = (
    select(RUNS.c.name, CHECKPOINTS.c.step, SHARDS.c.rank, SHARDS.c.state, SHARDS.c.evicted_at)
    .join(CHECKPOINTS, CHECKPOINTS.c.run_id == RUNS.c.id)
    .join(SHARDS, SHARDS.c.checkpoint_id == CHECKPOINTS.c.id)
)


@dataclass(frozen=True)
class ShardState:
    uploading: bool  # its upload has not ended
    evicted: bool  # T0 eviction passed over it: no T0 copy wanted


def shard_states(connection: Connection, shards: Iterable[Shard]) -> dict[Shard, ShardState]:
    """The catalog's word on each of ``shards`` it holds (one statement)."""
    wanted = set(shards)
    if not wanted:
        return {}
    rows = connection.execute(
        _STATES.where(
            RUNS.c.name.in_(sorted({run for run, _, _ in wanted})),
            CHECKPOINTS.c.step.in_(sorted({step for _, step, _ in wanted})),
        )
    ).all()
    return {
        (row.name, row.step, row.rank): ShardState(
            uploading=row.state in UPLOADING, evicted=row.evicted_at is not None
        )
        for row in rows
        if (row.name, row.step, row.rank) in wanted
    }
