"""PostgreSQL: a batch of new checkpoints written in one statement.

On PostgreSQL every statement is a round trip, and on a busy node each one
waits for the agent's event loop and for the server's backend to get a CPU.
The batch write (batch_write.py) takes about ten of them: read what exists
(locked), then insert checkpoints, replicas, shards, files and jobs, each
insert needing the ids the previous one returned, then read the new
checkpoints' children.

When every checkpoint of a batch is new (a step's first registration, or
all its ranks in one batch: what a trainer's registration usually is),
nothing has to be read first: every rule a registration must pass is
decided from the batch itself (batch_write.decide). One statement then
does it all, data-modifying CTEs chained by the ids they return, the batch's
rows passed as JSON arrays (``jsonb_to_recordset``); the statement answers
each new checkpoint's id and its children.

One statement is atomic on its own: it runs without BEGIN and COMMIT
around it (the writer's connection in autocommit), one round trip in all.
If a checkpoint exists after all (another agent's ranks, an older batch),
its unique (run, step) fails the statement, nothing of it is left, and the
caller writes the batch the full way (``NotAllNew``).

The rows written are the same either way: the job rows are built by the
same functions (jobs/kinds.py), their dedupe key rebuilt in SQL from the
same format (checked at import), and a test compares both ways' rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    Integer,
    String,
    Text,
    and_,
    bindparam,
    column,
    func,
    literal,
    select,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ..jobs import kinds, queue
from ..models import PRIORITY, ReplicaState, ShardState
from ..resources import Resources
from ..storage import layout
from .batch_plan import Planned, checkpoint_row
from .tables import CHECKPOINTS, FILES, JOBS, REPLICAS, RUNS, SHARDS

# The job rows carry no ids yet: the statement fills them in, and their
# dedupe key, from this format (queue.dedupe_key).
_KEY_PROBE = queue.dedupe_key("kind", 11, 22, None), queue.dedupe_key("kind", 11, 22, "r")
if _KEY_PROBE != ("kind:11:22:-", "kind:11:22:r"):
    raise RuntimeError("queue.dedupe_key changed: rebuild it in fresh_batch._jobs too")


class NotAllNew(Exception):
    """A checkpoint of the batch exists already: write it the full way."""


def _rows(name: str, columns: Sequence[tuple[str, Any]], alias: str | None = None) -> Any:
    """``jsonb_to_recordset(:name) AS alias(col type, ...)``: a JSON array
    parameter as rows (keys not named here are ignored)."""
    return (
        func.jsonb_to_recordset(bindparam(name, type_=postgresql.JSONB))
        .table_valued(*(column(n, t) for n, t in columns))
        .render_derived(name=alias or name, with_types=True)
    )


_CHECKPOINT_COLUMNS = (
    ("run_id", Integer),
    ("step", BigInteger),
    ("state", String),
    ("world_size", Integer),
    ("epoch", BigInteger),
    ("priority", String),
    ("metrics", JSON),
    ("metadata", JSON),
    ("parent_run", String),
    ("parent_step", BigInteger),
    ("write_seconds", Float),
    ("total_bytes", BigInteger),
    ("file_count", Integer),
    ("created_at", postgresql.TIMESTAMP),
)
_JOB_COLUMNS = (
    ("kind", String),
    ("state", String),
    ("priority", Integer),
    ("region", String),
    ("node", String),
    ("payload", JSON),
    ("attempts", Integer),
    ("max_attempts", Integer),
    ("run_after", postgresql.TIMESTAMP),
    ("created_at", postgresql.TIMESTAMP),
    ("updated_at", postgresql.TIMESTAMP),
)


def _statement() -> Any:
    now = bindparam("now", type_=postgresql.TIMESTAMP)
    cps = _rows("cps", (("k", Integer), *_CHECKPOINT_COLUMNS))
    checkpoint_columns = [name for name, _ in _CHECKPOINT_COLUMNS]
    inserted = (
        postgresql.insert(CHECKPOINTS)
        .from_select(
            [*checkpoint_columns, "updated_at", "pinned"],
            select(*(cps.c[name] for name in checkpoint_columns), now, literal(False)),
        )
        # No ON CONFLICT: a checkpoint that exists fails the whole statement,
        # so that nothing of the batch is left when it runs without a
        # transaction around it.
        .returning(CHECKPOINTS.c.id, CHECKPOINTS.c.run_id, CHECKPOINTS.c.step)
        .cte("cp")
    )
    # The same checkpoint rows again: RETURNING sees only the inserted row, not its k.
    keys = _rows("cps", (("k", Integer), ("run_id", Integer), ("step", BigInteger)), "cpk")
    keyed = (
        select(inserted.c.id, keys.c.k)
        .join_from(
            inserted, keys, and_(inserted.c.run_id == keys.c.run_id, inserted.c.step == keys.c.step)
        )
        .cte("keyed")
    )

    replicas = _rows("reps", (("k", Integer), ("region", String), ("uri", Text)))
    replica_rows = (
        REPLICAS.insert()
        .from_select(
            ["checkpoint_id", "region", "state", "uri", "created_at"],
            select(
                keyed.c.id,
                replicas.c.region,
                literal(ReplicaState.PENDING.value),
                replicas.c.uri,
                now,
            ).join_from(replicas, keyed, replicas.c.k == keyed.c.k),
        )
        .cte("rep")
    )

    shards = _rows(
        "shs",
        (
            ("k", Integer),
            ("rank", Integer),
            ("node", String),
            ("path", Text),
            ("is_directory", Boolean),
            ("fingerprint", String),
        ),
    )
    shard_rows = (
        SHARDS.insert()
        .from_select(
            [
                "checkpoint_id",
                "rank",
                "node",
                "path",
                "is_directory",
                "state",
                "fingerprint",
                "created_at",
            ],
            select(
                keyed.c.id,
                shards.c.rank,
                shards.c.node,
                shards.c.path,
                shards.c.is_directory,
                literal(ShardState.REGISTERED.value),
                shards.c.fingerprint,
                now,
            ).join_from(shards, keyed, shards.c.k == keyed.c.k),
        )
        .returning(SHARDS.c.id, SHARDS.c.checkpoint_id, SHARDS.c.rank)
        .cte("sh")
    )
    shard_keys = (
        select(shard_rows.c.id.label("shard_id"), shard_rows.c.checkpoint_id, shard_rows.c.rank)
        .add_columns(keyed.c.k)
        .join_from(shard_rows, keyed, shard_rows.c.checkpoint_id == keyed.c.id)
        .cte("shk")
    )

    files = _rows(
        "fis",
        (
            ("k", Integer),
            ("rank", Integer),
            ("path", Text),
            ("size", BigInteger),
            ("mtime_ns", BigInteger),
            ("expected_sha256", String),
        ),
    )
    file_rows = (
        FILES.insert()
        .from_select(
            ["shard_id", "path", "size", "mtime_ns", "expected_sha256"],
            select(shard_keys.c.shard_id, files.c.path, files.c.size, files.c.mtime_ns)
            .add_columns(files.c.expected_sha256)
            .join_from(
                files,
                shard_keys,
                and_(files.c.k == shard_keys.c.k, files.c.rank == shard_keys.c.rank),
            ),
        )
        .cte("fi")
    )

    jobs = _rows("jbs", (("k", Integer), ("rank", Integer), *_JOB_COLUMNS))
    job_columns = [name for name, _ in _JOB_COLUMNS]
    dedupe = func.concat_ws(
        ":",
        jobs.c.kind,
        shard_keys.c.checkpoint_id,
        shard_keys.c.shard_id,
        func.coalesce(jobs.c.region, "-"),
    )
    job_rows = (
        postgresql.insert(JOBS)
        .from_select(
            [*job_columns, "checkpoint_id", "shard_id", "dedupe_key"],
            select(
                *(jobs.c[name] for name in job_columns),
                shard_keys.c.checkpoint_id,
                shard_keys.c.shard_id,
                dedupe,
            ).join_from(
                jobs, shard_keys, and_(jobs.c.k == shard_keys.c.k, jobs.c.rank == shard_keys.c.rank)
            ),
        )
        .on_conflict_do_nothing(index_elements=["dedupe_key"])
        .cte("jo")
    )

    # Each new checkpoint's id, and the checkpoints registered before it that
    # name it as their parent (the statement's snapshot: rows written before it).
    parents = _rows("cps", (("k", Integer), ("run", String), ("step", BigInteger)), "par")
    child = CHECKPOINTS.alias("child")
    children = (
        select(
            func.coalesce(
                func.json_agg(func.json_build_array(RUNS.c.name, child.c.step)),
                literal("[]").cast(JSON),
                type_=JSON,
            )
        )
        .select_from(child.join(RUNS, RUNS.c.id == child.c.run_id))
        .where(child.c.parent_run == parents.c.run, child.c.parent_step == parents.c.step)
        .scalar_subquery()
    )
    return (
        select(keyed.c.k, keyed.c.id, children.label("children"))
        .join_from(keyed, parents, parents.c.k == keyed.c.k)
        .add_cte(replica_rows, file_rows, job_rows)
    )


_STATEMENT = _statement()


def _json_ready(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


def write(
    conn: Connection,
    checkpoints: Sequence[dict[str, Any]],
    replicas: Sequence[dict[str, Any]],
    shards: Sequence[dict[str, Any]],
    files: Sequence[dict[str, Any]],
    jobs: Sequence[dict[str, Any]],
    now: datetime,
) -> dict[int, tuple[int, list[tuple[str, int]]]]:
    """Insert the batch; ``k`` keys each checkpoint, ``(k, rank)`` each shard.
    Returns k -> (checkpoint id, its children); raises ``NotAllNew`` when a
    checkpoint existed (the statement failed whole: nothing was written)."""
    params = {
        "now": now,
        "cps": [_json_ready(row) for row in checkpoints],
        "reps": list(replicas),
        "shs": list(shards),
        "fis": list(files),
        "jbs": [_json_ready(row) for row in jobs],
    }
    try:
        rows = conn.execute(_STATEMENT, params).all()
    except IntegrityError as exc:
        # A checkpoint of the batch exists (the unique (run, step)); any
        # other refusal is the full way's to report.
        raise NotAllNew() from exc
    # Every checkpoint inserted (none existed: the statement would have failed).
    return {
        k: (checkpoint_id, [(name, step) for name, step in sorted(children)])
        for k, checkpoint_id, children in rows
    }


def write_new(
    resources: Resources,
    conn: Connection,
    plans: dict[tuple[int, int], Planned],
    now: Any,
    node: str,
) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """The batch's new checkpoints in one statement: the same rows as
    ``batch_write._insert``; returns their children."""
    settings = resources.settings
    ordered = [plans[key] for key in sorted(plans) if plans[key].added]
    checkpoints: list[dict[str, Any]] = []
    replicas: list[dict[str, Any]] = []
    shards: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    for k, plan in enumerate(ordered):
        assert plan.new
        checkpoints.append({"k": k, "run": plan.run, **checkpoint_row(plan)})
        replicas.extend(
            {"k": k, "region": region, "uri": store.uri(layout.step_prefix(plan.run, plan.key[1]))}
            for region, store in resources.stores.items()
        )
        for _, reg in plan.added:
            rank = reg.request.rank
            # An urgent registration of the same content later in the batch
            # promotes the checkpoint's jobs (``_promote`` on the full way).
            priority = PRIORITY["urgent" if plan.promote else reg.request.priority]
            shards.append(
                {
                    "k": k,
                    "rank": rank,
                    "node": node,
                    "path": str(reg.scanned.directory),
                    "is_directory": reg.scanned.is_directory,
                    "fingerprint": reg.fingerprint,
                }
            )
            files.extend(
                {
                    "k": k,
                    "rank": rank,
                    "path": f.path,
                    "size": f.size,
                    "mtime_ns": f.mtime_ns,
                    "expected_sha256": reg.hashes.get(f.path),
                }
                for f in reg.scanned.files
            )
            # Ids and dedupe keys are filled in by the statement.
            rows = [
                kinds.upload_row(
                    0,
                    shard_id=0,
                    region=settings.primary_region.name,
                    node=node,
                    mode=kinds.UploadMode.PRIMARY,
                    worker=settings.worker,
                    priority=priority,
                    now=now,
                )
            ]
            if settings.peers.copies:
                rows.append(
                    kinds.peer_push_row(0, shard_id=0, node=node, priority=priority, now=now)
                )
            jobs.extend({"k": k, "rank": rank, **row} for row in rows)
    written = write(conn, checkpoints, replicas, shards, files, jobs, now)
    children: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for k, plan in enumerate(ordered):
        plan.id, plan_children = written[k]
        if plan_children:
            children[(plan.run, plan.key[1])] = plan_children
    return children


__all__ = ["NotAllNew", "write", "write_new"]
