"""When a staged segment is written to T0: once its upload has ended.

The persister registers a staged segment at once, and the upload starts
reading it from memory. Written to T0 during that upload, the same
checkpoint's T0 copy takes disk, memory bandwidth and CPU time from the copy
that makes it durable: a 605 MB save became durable 6 % later than the same
save staged on disk (benchmarks/README.md, "Issue 16 on a twenty-third
machine"). So the T0 write waits for the shard's upload to end (uploaded,
or failed), for at most ``[memory] t0_wait_seconds``, and not at all once a
reservation finds the arena full: memory is freed only when T0 holds the
bytes.

What waiting risks: until T0 holds it, the checkpoint is in memory only. A
killed trainer or agent loses nothing (segments are files in a tmpfs that
outlive both); a node that reboots before the upload ends loses it, where
T0 written first might have kept it for a node whose disk survived. It was
not durable, so `latest` never named it; the run resumes from the one
before.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.engine import Connection

from ..checkpoints.tables import CHECKPOINTS, RUNS, SHARDS
from ..models import ShardState

# A shard in these states is still on its way to the store.
UPLOADING = (ShardState.REGISTERED.value, ShardState.UPLOADING.value)

Shard = tuple[str, int, int]  # run, step, rank

_STATES = (
    select(RUNS.c.name, CHECKPOINTS.c.step, SHARDS.c.rank, SHARDS.c.state)
    .join(CHECKPOINTS, CHECKPOINTS.c.run_id == RUNS.c.id)
    .join(SHARDS, SHARDS.c.checkpoint_id == CHECKPOINTS.c.id)
)


def still_uploading(connection: Connection, shards: Iterable[Shard]) -> set[Shard]:
    """Those of ``shards`` whose upload has not ended (one statement)."""
    wanted = set(shards)
    if not wanted:
        return set()
    rows = connection.execute(
        _STATES.where(
            RUNS.c.name.in_(sorted({run for run, _, _ in wanted})),
            CHECKPOINTS.c.step.in_(sorted({step for _, step, _ in wanted})),
        )
    ).all()
    return {
        (row.name, row.step, row.rank)
        for row in rows
        if (row.name, row.step, row.rank) in wanted and row.state in UPLOADING
    }
