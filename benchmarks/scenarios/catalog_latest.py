"""`latest` with 100,000 checkpoints in the catalog, on SQLite and PostgreSQL.

The question every restart asks must stay fast when a catalog has grown:
``GET /v1/runs/{run}/latest`` (and ``?region=``, except with ``--quick``) is
timed through HTTP against a real ``tierckpt serve`` (workers off), one
keep-alive client, sequential requests after a warm-up; p50/p99/max per
database. The
in-process catalog read (``latest_answer.read_latest_rows``) is timed too, to tell
the database's share from the HTTP/app share.

The catalog is built by the real migrations (``tierckpt.service.migrate``,
what ``tierckpt migrate`` and ``serve`` run), then seeded in bulk (SQLAlchemy
Core executemany on SQLite, COPY on PostgreSQL), not through the API, in the
shape the register path and the workers leave it (checkpoint, one shard per
rank, its files, one replica row per configured region):

- one big run (``BIG_STEPS`` checkpoints, world_size 2, two files per rank)
  and ``SMALL_RUNS`` smaller runs (world_size 1, three files each);
- mostly durable/replicated: committed in ``east``; in ``west`` too for most
  (replicated), with the newest ~20 durable ones still pending there (so
  ``?region=west`` walks past them); old ones deleted by retention (replicas
  deleted), about 2 % failed, some corrupt (east corrupt, west never
  committed), a few quarantined;
- right at the top of every run, the newest steps are still ``registered``
  / ``uploading``, and just below them a failed, a quarantined and a
  corrupt one: `latest` must skip all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from devsupport import postgres as pg

from ..context import BUCKET, REGION_PREFIX, BenchContext, log, s3_region, settle
from ..procstat import cpu_seconds
from ..stats import percentile, row

NAME = "catalog_latest"
TITLE = "latest with 100,000 checkpoints in the catalog (ms; lower is better)"
REQUIRES: tuple[str, ...] = ()

TOTAL = 100_000
SMALL_RUNS = 9
SMALL_STEPS = 2_000
BIG_STEPS = TOTAL - SMALL_RUNS * SMALL_STEPS
BIG_RUN = "bench-latest-big"
REGIONS = ("east", "west")
# Requests before timing: the agent's and the database's caches warm up.
WARMUP = 200
QUICK_WARMUP = 50  # `make bench QUICK=1` must stay under 3 minutes
TARGET_P99_MS = 5.0


# Column order of the generated tuples, per table (explicit, so a column
# another revision adds with a default does not shift anything).
COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("id", "name", "created_at"),
    "checkpoints": (
        "id",
        "run_id",
        "step",
        "state",
        "world_size",
        "epoch",
        "priority",
        "metrics",
        "metadata",
        "parent_run",
        "parent_step",
        "write_seconds",
        "total_bytes",
        "file_count",
        "error",
        "created_at",
        "updated_at",
        "durable_at",
        "pinned",
        "quarantined_at",
        "quarantine_reason",
        "deleted_at",
        "deleted_reason",
    ),
    "shards": (
        "id",
        "checkpoint_id",
        "rank",
        "node",
        "path",
        "is_directory",
        "state",
        "fingerprint",
        "error",
        "created_at",
        "uploaded_at",
        "evicted_at",
    ),
    "files": ("id", "shard_id", "path", "size", "mtime_ns", "expected_sha256", "sha256"),
    "replicas": (
        "id",
        "checkpoint_id",
        "region",
        "state",
        "uri",
        "manifest_sha256",
        "error",
        "created_at",
        "committed_at",
        "verified_at",
    ),
}

# Replica states (east, west) the workers leave for each checkpoint state.
REPLICA_STATES = {
    "registered": ("pending", "pending"),
    "uploading": ("pending", "pending"),
    "failed": ("pending", "pending"),
    "corrupt": ("corrupt", "pending"),
    "deleted": ("deleted", "deleted"),
    "durable": ("committed", "pending"),
    "replicated": ("committed", "committed"),
}
SHARD_STATES = {"registered": "registered", "uploading": "uploading", "failed": "failed"}


@dataclass
class Rows:
    """Every row to insert, per table, as tuples in COLUMNS order."""

    tables: dict[str, list[tuple[Any, ...]]] = field(
        default_factory=lambda: {name: [] for name in COLUMNS}
    )
    # What `latest` must answer, per (run, region or None): the step.
    expected: dict[tuple[str, str | None], int] = field(default_factory=dict)

    def count(self, table: str) -> int:
        return len(self.tables[table])


def _top_states() -> list[str]:
    """The states of a run's newest steps, newest first: in flight, then a
    failed, a quarantined and a corrupt one `latest` must pass over."""
    return ["registered", "uploading", "uploading", "failed", "quarantined", "corrupt"]


def _hex(n: int) -> str:
    return f"{n:064x}"  # shaped like a SHA-256; the content does not matter here


def generate(seed: int = 6) -> Rows:
    rng = random.Random(seed)
    rows = Rows()
    add_checkpoint = rows.tables["checkpoints"].append
    add_shard = rows.tables["shards"].append
    add_file = rows.tables["files"].append
    add_replica = rows.tables["replicas"].append
    epoch = datetime(2026, 1, 1)
    took, hours, day = timedelta(seconds=40), timedelta(hours=1), timedelta(days=1)
    checkpoint_id = shard_id = file_id = replica_id = 0
    runs = [(BIG_RUN, BIG_STEPS, 2, ("model.pt", "optim.pt"))] + [
        (
            f"bench-latest-{n:02d}",
            SMALL_STEPS,
            1,
            ("model.safetensors", "optimizer.pt", "trainer_state.json"),
        )
        for n in range(SMALL_RUNS)
    ]
    for run_id, (run, steps, world_size, names) in enumerate(runs, start=1):
        rows.tables["runs"].append((run_id, run, epoch))
        top = _top_states()
        deleted_below = int(steps * 0.6)  # retention removed the oldest 60 %
        west_lag = 20  # the newest durable ones are not in west yet
        answer: dict[str | None, int] = {}
        for i in range(steps - 1, -1, -1):  # newest first, to know the answers
            step = (i + 1) * 100
            created = epoch + timedelta(seconds=60 * i + run_id)
            done = created + took
            from_top = steps - 1 - i
            state = top[from_top] if from_top < len(top) else ""
            quarantined = state == "quarantined"
            if quarantined:
                state = "durable"
            elif not state:
                roll = rng.random()
                if i < deleted_below:
                    state = "deleted"
                elif roll < 0.02:
                    state = "failed"
                elif roll < 0.025:
                    state = "corrupt"
                else:
                    state = "durable" if from_top - len(top) < west_lag else "replicated"
                    quarantined = rng.random() < 0.003
            checkpoint_id += 1
            ever_durable = state in ("durable", "replicated", "corrupt", "deleted")
            deleted = state == "deleted"
            failed = state == "failed"
            file_size = rng.randrange(1 << 20, 1 << 30)
            add_checkpoint(
                (
                    checkpoint_id,
                    run_id,
                    step,
                    state,
                    world_size,
                    step // 1000,
                    "normal",
                    {"loss": round(3.0 / (1 + i / 1000), 5)},
                    {},
                    run if i else None,
                    step - 100 if i else None,
                    round(rng.uniform(2, 30), 3),
                    file_size * world_size * len(names),
                    world_size * len(names),
                    "upload failed: connection reset" if failed else None,
                    created,
                    done,
                    done if ever_durable else None,
                    False,
                    created + day if quarantined else None,
                    "loss spike" if quarantined else None,
                    created + 3 * day if deleted else None,
                    "retention: keep_last" if deleted else None,
                )
            )
            shard_state = SHARD_STATES.get(state, "uploaded")
            uploaded = shard_state == "uploaded"
            directory = f"/ssd/checkpoints/{run}/step-{step}"
            mtime_ns = int(created.timestamp()) * 1_000_000_000
            evicted = created + hours if from_top > 10 else None
            for rank in range(world_size):
                shard_id += 1
                add_shard(
                    (
                        shard_id,
                        checkpoint_id,
                        rank,
                        f"node-{rank:03d}",
                        directory,
                        True,
                        shard_state,
                        _hex(shard_id),
                        None,
                        created,
                        done if uploaded else None,
                        evicted,
                    )
                )
                for name in names:
                    file_id += 1
                    add_file(
                        (
                            file_id,
                            shard_id,
                            name,
                            file_size,
                            mtime_ns,
                            None,
                            _hex(file_id) if uploaded else None,
                        )
                    )
            replica_states = REPLICA_STATES[state]
            for region, replica_state in zip(REGIONS, replica_states, strict=True):
                replica_id += 1
                committed = replica_state != "pending"  # corrupt/deleted were committed once
                add_replica(
                    (
                        replica_id,
                        checkpoint_id,
                        region,
                        replica_state,
                        f"s3://{BUCKET}/{REGION_PREFIX}/{region}/{run}/step-{step:012d}/",
                        _hex(replica_id) if committed else None,
                        "sha256 mismatch" if replica_state == "corrupt" else None,
                        created,
                        done if committed else None,
                        created + 6 * hours if committed else None,
                    )
                )
            if state in ("durable", "replicated") and not quarantined:
                answer.setdefault(None, step)
                for region, replica_state in zip(REGIONS, replica_states, strict=True):
                    if replica_state == "committed":
                        answer.setdefault(region, step)
        for where, step in answer.items():
            rows.expected[(run, where)] = step
    return rows


# -- seeding ------------------------------------------------------------------


def migrate(url: str) -> None:
    """The real schema: the same Alembic upgrade `tierckpt migrate` runs."""
    from tierckpt.service.migrate import upgrade

    upgrade(url)


def _converters(name: str, dialect: Any, *, json_as_text: bool) -> list[Any]:
    """Per column, what SQLAlchemy would do to the value before the driver
    sees it (SQLite: its DateTime string format, JSON text; PostgreSQL COPY:
    JSON text only, asyncpg takes the rest as they are)."""
    from sqlalchemy import JSON

    from tierckpt.service.models import Base

    table = Base.metadata.tables[name]
    by_name = {c.name: c for c in table.columns}
    out = []
    for column_name in COLUMNS[name]:
        column = by_name[column_name]
        if isinstance(column.type, JSON):
            out.append(json.dumps if json_as_text else None)
        elif dialect is not None:
            out.append(column.type.bind_processor(dialect))
        else:
            out.append(None)
    return out


def _converted(records: list[tuple[Any, ...]], converters: list[Any]) -> list[tuple[Any, ...]]:
    if not any(converters):
        return records
    pairs = list(enumerate(converters))
    return [
        tuple(c(r[i]) if c is not None and r[i] is not None else r[i] for i, c in pairs)
        for r in records
    ]


def seed_sqlite(path: Path, rows: Rows) -> None:
    """Bulk INSERT through SQLAlchemy (executemany on its connection), one
    transaction, values converted by the columns' own SQLAlchemy types."""
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as connection:
            # Only for this bulk load (per connection): the agent reopens with
            # its own settings (WAL, synchronous=FULL).
            connection.exec_driver_sql("PRAGMA synchronous=OFF")
            for name, columns in COLUMNS.items():
                converters = _converters(name, engine.dialect, json_as_text=True)
                statement = (
                    f"INSERT INTO {name} ({', '.join(columns)}) "
                    f"VALUES ({', '.join('?' for _ in columns)})"
                )
                records = rows.tables[name]
                for start in range(0, len(records), 50_000):
                    chunk = _converted(records[start : start + 50_000], converters)
                    connection.exec_driver_sql(statement, chunk)
    finally:
        engine.dispose()


def seed_postgres(url: str, rows: Rows) -> None:
    """COPY (binary, asyncpg, foreign-key triggers off) into the migrated
    database, move the id sequences past the rows, then VACUUM ANALYZE: what
    autovacuum does after a bulk load, done here so it cannot start during
    the timed requests and compete with them for the 2 cores; then CHECKPOINT."""
    import asyncpg

    async def load() -> None:
        connection = await asyncpg.connect(pg.asyncpg_dsn(url))
        try:
            # The generated rows are consistent by construction (and every
            # agent's answer is checked against them): checking each row's
            # foreign keys on the way in doubled the load's time. Only a
            # superuser may turn that off; anyone else loads with the checks.
            with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
                await connection.execute("SET session_replication_role = replica")
            async with connection.transaction():
                for name, columns in COLUMNS.items():
                    records = _converted(
                        rows.tables[name], _converters(name, None, json_as_text=True)
                    )
                    await connection.copy_records_to_table(
                        name, records=records, columns=list(columns)
                    )
                    await connection.execute(
                        f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                        f"(SELECT max(id) FROM {name}))"
                    )
            await connection.execute("VACUUM ANALYZE")
            # And write the load out now: left to the checkpointer, gigabytes
            # of dirty buffers were flushed during the timed requests.
            await connection.execute("CHECKPOINT")
        finally:
            await connection.close()

    asyncio.run(load())


class _Child:
    """A function running in a forked process: ``result()`` waits for it and
    gives its seconds, or raises if it failed."""

    def __init__(self, process: Any, seconds: Any) -> None:
        self._process = process
        self._seconds = seconds

    def result(self) -> float:
        self._process.join()
        if self._process.exitcode != 0:
            raise RuntimeError(f"seeding child failed (exit code {self._process.exitcode})")
        return float(self._seconds.value)


def _timed_exit(function: Any, seconds: Any, *args: Any) -> None:
    began = time.monotonic()
    function(*args)
    seconds.value = time.monotonic() - began


def _in_child(function: Any, *args: Any) -> _Child:
    context = multiprocessing.get_context("fork")
    seconds = context.Value("d", 0.0)
    process = context.Process(target=_timed_exit, args=(function, seconds, *args))
    process.start()
    return _Child(process, seconds)


# -- measuring ----------------------------------------------------------------


def _timed_requests(
    url: str, pid: int, path: str, count: int, warmup: int = WARMUP
) -> tuple[list[float], float]:
    """`count` sequential GETs on one keep-alive connection: seconds each, and
    the agent's CPU seconds per request (/proc: all its threads), a figure a
    loaded machine disturbs much less than the latencies."""
    out: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(warmup):
            http.get(path).raise_for_status()
        cpu_before = cpu_seconds(pid)
        for _ in range(count):
            began = time.perf_counter()
            answer = http.get(path)
            out.append(time.perf_counter() - began)
            answer.raise_for_status()
        cpu = (cpu_seconds(pid) - cpu_before) / count
    return out, cpu


def _check_answers(url: str, rows: Rows) -> int:
    """Every run's `latest` (and per region) is exactly the expected step."""
    wrong = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        for (run, region), step in rows.expected.items():
            params = {"region": region} if region else {}
            got = http.get(f"/v1/runs/{run}/latest", params=params).json()
            if got.get("step") != step:
                wrong += 1
                log(f"latest {run} region={region}: {got.get('step')} != expected {step}")
    return wrong


def _query_times(
    catalog_url: str, run: str, count: int, *, quick: bool = False
) -> dict[str, list[float]]:
    """In-process: the catalog read `latest` runs (latest_answer.read_latest_rows:
    one statement on PostgreSQL, two on the event loop on SQLite), through the
    service's own read engines (the event loop's own plain-sqlite connection
    on SQLite, the autocommit pool on PostgreSQL: row_reads.py), seconds
    each: the database's share of an answer. With ``quick``, without ``region=west``."""
    from tierckpt.service.checkpoints.latest_answer import read_latest_rows
    from tierckpt.service.db import (
        create_engine,
        create_read_sessionmaker,
        create_sync_readers,
        dispose_read_engine,
        dispose_sync_readers,
    )
    from tierckpt.service.row_reads import create_row_readers

    warmup = QUICK_WARMUP if quick else WARMUP

    async def measure() -> dict[str, list[float]]:
        engine = create_engine(catalog_url)
        sessions = create_read_sessionmaker(engine)
        threaded = create_sync_readers(engine)
        rows = create_row_readers(
            engine, sessions.kw["bind"], threaded.kw["bind"] if threaded is not None else None
        )
        out: dict[str, list[float]] = {"any": []} if quick else {"any": [], "west": []}
        try:
            for region, times in out.items():
                where = None if region == "any" else region
                for n in range(warmup + count):
                    began = time.perf_counter()
                    found = await read_latest_rows(rows, run, 1, where)
                    if n >= warmup:
                        times.append(time.perf_counter() - began)
                    assert found is not None
        finally:
            # As the agent's close_resources does.
            rows.dispose()
            dispose_sync_readers(threaded)
            await dispose_read_engine(sessions, engine)
            await engine.dispose()
        return out

    return asyncio.run(measure())


def _regions(ctx: BenchContext) -> list[dict[str, Any]]:
    return [s3_region(name, ctx.seaweed, f"{REGION_PREFIX}-latest-{name}") for name in REGIONS]


def _sizes(rows: Rows) -> str:
    return ", ".join(f"{rows.count(name)} {name}" for name in COLUMNS)


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50) * 1000,
        "p99": percentile(values, 99) * 1000,
        "max": max(values) * 1000,
    }


def run(ctx: BenchContext) -> dict[str, Any]:
    count = 500 if ctx.quick else 2000
    reps = max(1, min(ctx.reps, 3))
    per_rep = max(100, count // reps)
    began = time.monotonic()
    rows = generate()
    log(f"latest: generated {_sizes(rows)} in {time.monotonic() - began:.1f}s")
    admin = pg.postgres_admin_url()
    database = pg.create_temp_database(admin)
    sqlite_path = ctx.work / "latest-catalog.db"
    catalogs = {"sqlite": f"sqlite+aiosqlite:///{sqlite_path}", "postgres": database}
    seed_seconds: dict[str, float] = {}
    http: dict[str, dict[str, list[dict[str, float]]]] = {}
    queries: dict[str, dict[str, list[dict[str, float]]]] = {}
    wrong = 0
    sizes = _sizes(rows)
    try:
        began = time.monotonic()
        for url in catalogs.values():
            migrate(url)  # one at a time: Alembic's environment is process-global
        migrated = time.monotonic() - began
        log(f"latest: both catalogs migrated in {migrated:.1f}s")

        # Side by side: SQLite in a forked child (it inherits the generated
        # rows), PostgreSQL here. Threads were slower than one after the
        # other (one GIL for two Python-bound loads); processes are not.
        began = time.monotonic()
        sqlite_seconds = _in_child(seed_sqlite, sqlite_path, rows)
        seed_postgres(catalogs["postgres"], rows)
        seed_seconds["postgres"] = time.monotonic() - began
        seed_seconds["sqlite"] = sqlite_seconds.result()
        for db, seconds in seed_seconds.items():
            log(f"latest: {db} seeded in {seconds:.1f}s")
        # The generated rows (~500,000 tuples) are loaded; kept, every full
        # collection in this process walked them between two timed requests,
        # and that pause was counted as the agent's latency.
        rows.tables.clear()
        gc.collect()
        gc.freeze()
        started = ctx.start_agents(
            {
                f"latest-{db}": {
                    "worker": False,
                    "catalog": {"url": url},
                    "regions": _regions(ctx),
                    # One client asking as fast as it can exceeds the default
                    # per-caller limit (200/s): the limiter would answer 429.
                    "server": {"rate_limit_per_second": 1_000_000, "rate_limit_burst": 1_000_000},
                }
                for db, url in catalogs.items()
            }
        )
        agents = {db: started[f"latest-{db}"] for db in catalogs}
        for agent in agents.values():
            wrong += _check_answers(agent.url, rows)
        paths = {"latest": f"/v1/runs/{BIG_RUN}/latest"}
        if not ctx.quick:  # quick mode: only what the target is about
            paths["latest?region=west"] = f"/v1/runs/{BIG_RUN}/latest?region=west"
        for rep in range(reps):
            # The earlier scenarios' (and the seeding's) writes still being
            # flushed would stall these reads: out of the way first.
            settle()
            for db, agent in agents.items():
                for variant, path in paths.items():
                    latencies, cpu = _timed_requests(
                        agent.url, agent.pid, path, per_rep, QUICK_WARMUP if ctx.quick else WARMUP
                    )
                    figures = {**_ms(latencies), "cpu": cpu * 1000}
                    http.setdefault(f"{db} {variant}", {}).setdefault("reps", []).append(figures)
                    log(
                        f"latest rep {rep + 1}/{reps} {db} {variant}: p50 {figures['p50']:.2f} ms, "
                        f"p99 {figures['p99']:.2f} ms, max {figures['max']:.2f} ms, "
                        f"agent CPU {figures['cpu']:.2f} ms/request"
                    )
        for db, url in catalogs.items():
            times = _query_times(url, BIG_RUN, min(per_rep, 300), quick=ctx.quick)
            for variant, values in times.items():
                label = "read_latest_rows" if variant == "any" else "read_latest_rows region=west"
                figures = _ms(values)
                queries.setdefault(f"{db} {label}", {}).setdefault("reps", []).append(figures)
                log(f"latest in-process {db} {label}: p50 {figures['p50']:.3f} ms")
        for agent in agents.values():
            ctx.stop_agent(agent)
    finally:
        gc.unfreeze()
        pg.drop_database(database, admin)

    out_rows = []
    for label, data in http.items():
        for stat in ("p50", "p99", "max", "cpu"):
            out_rows.append(
                row(
                    f"HTTP {label}",
                    "agent CPU/request" if stat == "cpu" else stat,
                    "ms",
                    [r[stat] for r in data["reps"]],
                    note=f"{per_rep} sequential GETs per rep, keep-alive" if stat == "p50" else "",
                )
            )
    for label, data in queries.items():
        for stat in ("p50", "p99"):
            out_rows.append(row(f"in-process {label}", stat, "ms", [r[stat] for r in data["reps"]]))
    return {
        "rows": out_rows,
        "notes": [
            f"{sizes}; {BIG_STEPS} checkpoints in {BIG_RUN} (world_size 2, timed), "
            f"{SMALL_RUNS} runs of {SMALL_STEPS}; newest steps in flight/failed/quarantined/"
            "corrupt, 60 % deleted by retention",
            "seeded in "
            + ", ".join(f"{db} {seconds:.1f}s" for db, seconds in seed_seconds.items())
            + " (bulk load, after the migrations)",
            f"wrong latest answers: {wrong} (checked for every run and region)",
            f"target: p99 ≤ {TARGET_P99_MS:g} ms",
        ],
        "details": {
            "http": http,
            "in_process": queries,
            "seed_seconds": seed_seconds,
            "wrong_answers": wrong,
            "expected": {f"{run} {region}": step for (run, region), step in rows.expected.items()},
        },
    }
