"""Catalog engine and sessions for SQLite (embedded) and PostgreSQL (shared)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, bindparam, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.elements import BindParameter

from .observability import metrics
from .sqlite_driver import LOCK_WAIT, busy, connector
from .write_gate import READ_ONLY, GaveWay, giving_way, raising_urgent

T = TypeVar("T")

# PostgreSQL: how long opening a connection, and any one statement of the
# service, may take before the catalog counts as unreachable (503 to the
# caller, a pause for the worker). Without them, a partitioned network (no
# reset, no answer) would hold each request for ever: asyncpg's own connect
# timeout is 60 s and its statements have none.
CONNECT_TIMEOUT = 5.0
STATEMENT_TIMEOUT = 30.0


def _bounded_connect_args() -> dict[str, Any]:
    return {"timeout": CONNECT_TIMEOUT, "command_timeout": STATEMENT_TIMEOUT}


def create_engine(url: str, *, bounded: bool = False, **kwargs: Any) -> AsyncEngine:
    """The catalog engine. ``bounded``: the service's connect and statement
    timeouts (PostgreSQL); off for migrations and a catalog rebuild, whose
    statements may rightly run longer."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        connect_args = _bounded_connect_args() if bounded else {"timeout": CONNECT_TIMEOUT}
        engine = create_async_engine(
            url,
            pool_size=10,
            max_overflow=20,
            pool_use_lifo=True,  # see _ping_when_idle
            connect_args=connect_args,
            **kwargs,
        )
        # Not pool_pre_ping: through asyncpg it is three round trips (BEGIN,
        # the ping, ROLLBACK) before every transaction the worker and the
        # passes run, a share of the catalog's work and of each job's.
        _ping_when_idle(engine, PING_AFTER_IDLE)
        return engine

    if not parsed.database or parsed.database == ":memory:":
        engine = create_async_engine(url, connect_args={"timeout": 30}, **kwargs)
        _sqlite_transactions(engine.sync_engine, synchronous="FULL")
        return engine
    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    # Write transactions inline on the loop, the commit's fsync after the
    # lock (sqlite_driver.py, wal_sync.py).
    engine = create_async_engine(url, async_creator=connector(parsed.database), **kwargs)
    _sqlite_transactions(engine.sync_engine, synchronous="NORMAL")
    return engine


def create_sync_engine(
    engine: AsyncEngine, pool_size: int = 1, *, eager_lock: bool = False, never_wait: bool = False
) -> Engine | None:
    """A synchronous (pysqlite) engine on the same SQLite file as ``engine``,
    with the same settings, for work that runs whole in one worker thread
    (the registration writer, hot reads); None for PostgreSQL or an
    in-memory database. ``eager_lock``: its transactions ask for the write
    lock again every fraction of a millisecond while another process holds
    it (``_begin_eagerly``), not on SQLite's busy-handler schedule; it runs
    at ``synchronous=NORMAL`` with no autocheckpoint, as the async engine's
    connections (wal_sync.py): after its commit, the caller waits for
    ``wal_sync_for(database).sync()``. ``never_wait``: a statement that
    would wait for a lock fails at once (busy_timeout 0), for reads run on
    the event loop (``read_snapshot``)."""
    url = engine.url
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    sync = sa_create_engine(
        url.set(drivername="sqlite"),
        connect_args={"timeout": 30, "check_same_thread": False},
        pool_size=pool_size,
        max_overflow=1,
    )
    _sqlite_transactions(sync, eager_lock=eager_lock, never_wait=never_wait, synchronous="NORMAL")
    return sync


# An ``eager_lock`` engine's pauses between two tries for the write lock; it
# waits up to LOCK_WAIT (sqlite_driver.py), the busy_timeout of the others.
_EAGER_PAUSES = (0.0002, 0.0005, 0.001, 0.002)


def _begin_eagerly(dbapi_connection: Any) -> None:
    """BEGIN IMMEDIATE, retried after a short pause while another process
    (the worker process, another agent) holds the write lock.

    SQLite's busy handler sleeps 1, 2, 5, 10, 15, 20 ms… between tries: a
    registration finding a 3 ms job transaction in progress would wait 8 ms
    for it. The write gate spares that in one process; across processes the
    registration writer, on a trainer's critical path, polls instead."""
    try:
        dbapi_connection.execute("BEGIN IMMEDIATE")
        return
    except sqlite3.OperationalError as exc:
        if not busy(exc):
            raise
    # Taken: the worker process yields to us from its next transaction on
    # (write_gate.UrgentFlag), so we wait for the one holding it only.
    flag = raising_urgent()
    if flag is not None and flag.raised():
        flag = None  # raised for the whole batch by the writer (batching.py)
    if flag is not None:
        flag.raise_()
    try:
        deadline = time.monotonic() + LOCK_WAIT
        tries = 0
        while True:
            time.sleep(_EAGER_PAUSES[min(tries, len(_EAGER_PAUSES) - 1)])
            tries += 1
            try:
                dbapi_connection.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not busy(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
    finally:
        if flag is not None:
            flag.lower()


def in_sync_session(maker: sessionmaker[Session], read: Callable[..., T], *args: Any) -> T:
    """Run ``read`` in one (read-only) transaction of a plain Session of
    ``create_sync_readers``, in the calling thread (one hop to a thread for
    a whole read)."""
    with maker() as session, session.begin():
        return read(session, *args)


async def read_snapshot(
    inline: sessionmaker[Session] | None,
    threaded: sessionmaker[Session],
    read: Callable[..., T],
    *args: Any,
) -> T:
    """One whole read on SQLite's plain reader sessions, in one snapshot.

    ``inline`` given (``create_sync_readers(inline=True)``): on the event loop
    itself. A read of a few indexed rows takes a fraction of a millisecond,
    less than the two thread hand-offs it otherwise costs, each a wait for a
    CPU and for the GIL while the agent is busy. A WAL reader waits for
    nobody, except in rare moments (a read slot being reset, a connection
    holding the database exclusively): then SQLite answers busy at once, and
    the same read runs in a thread of ``threaded``, which may wait there."""
    if inline is not None:
        try:
            return in_sync_session(inline, read, *args)
        except OperationalError as exc:
            if not isinstance(exc.orig, sqlite3.OperationalError) or not busy(exc.orig):
                raise
    return await asyncio.to_thread(in_sync_session, threaded, read, *args)


def create_sync_readers(
    engine: AsyncEngine, *, inline: bool = False
) -> sessionmaker[Session] | None:
    """Read-only plain sessions on SQLite (snapshot reads, no write lock);
    None on PostgreSQL. Default: for a whole read in one hop to a thread.
    ``inline``: for reads on the event loop (``read_snapshot``), one at a
    time, never waiting for a lock."""
    sync = create_sync_engine(engine, pool_size=1 if inline else 4, never_wait=inline)
    if sync is None:
        return None
    return sessionmaker(sync.execution_options(**{READ_ONLY: True}), expire_on_commit=False)


def _sqlite_transactions(
    engine: Engine, *, synchronous: str, eager_lock: bool = False, never_wait: bool = False
) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control from the driver so BEGIN IMMEDIATE below is
        # what actually starts a transaction.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL lets readers run beside the one writer; each commit survives
        # power loss, not only a killed process: at FULL SQLite fsyncs in
        # COMMIT, at NORMAL the service does after it, the lock released
        # (wal_sync.py), and checkpoints on its own thread; foreign keys so
        # ON DELETE CASCADE holds as on PostgreSQL.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        if synchronous == "NORMAL":
            cursor.execute("PRAGMA wal_autocheckpoint=0")
        cursor.execute("PRAGMA foreign_keys=ON")
        # An eager-lock engine waits for the write lock itself (_begin_eagerly);
        # its statements inside a transaction never wait: it holds the lock.
        waits = not (eager_lock or never_wait)
        cursor.execute(f"PRAGMA busy_timeout={int(LOCK_WAIT * 1000) if waits else 0}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # SQLite is the single-writer path: taking the write lock at BEGIN
        # means a transaction never fails half-way with SQLITE_BUSY when it
        # upgrades from reading to writing; it waits its turn instead.
        # Read-only sessions (GET requests) take no lock at all: in WAL mode
        # they read a snapshot beside the writer instead of queueing behind
        # it (and holding up the uploads' and registrations' commits).
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        elif eager_lock:
            _begin_eagerly(conn.connection.driver_connection)
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def create_read_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions for requests that only read.

    SQLite: the same engine, with no write lock taken (see ``_on_begin``).
    PostgreSQL: a small engine of its own in autocommit. At READ COMMITTED
    every statement reads its own snapshot anyway, so a read gains nothing
    from a transaction, which cost two of a `latest` answer's nine round
    trips, plus two more in the pool's pre-ping (asyncpg pings inside a
    transaction of its own unless the connection is in autocommit); it pings
    only connections that sat idle (``_ping_when_idle``). Dispose of it with
    ``dispose_read_engine``."""
    if engine.dialect.name == "sqlite":
        return async_sessionmaker(
            engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False
        )
    readers = create_async_engine(
        engine.url,
        isolation_level="AUTOCOMMIT",
        pool_size=4,
        max_overflow=4,
        pool_use_lifo=True,  # see _ping_when_idle
        connect_args=_bounded_connect_args(),
    )
    _ping_when_idle(readers, PING_AFTER_IDLE)
    return async_sessionmaker(readers, expire_on_commit=False)


def create_writer_engine(
    engine: AsyncEngine, *, synchronous_commit: bool = True
) -> AsyncEngine | None:
    """PostgreSQL: a small engine of its own for the registration writer
    (its connections, like every engine's here, pinged only after sitting
    idle: ``_ping_when_idle``). Without ``synchronous_commit`` its commits
    return before the server has flushed them (``[catalog] register_ack =
    "committed"``). None on SQLite (the writer has its own engine there:
    ``create_sync_engine``). Dispose of it with the batcher."""
    if engine.dialect.name != "postgresql":
        return None
    connect_args = _bounded_connect_args()
    if not synchronous_commit:
        connect_args["server_settings"] = {"synchronous_commit": "off"}
    writer = create_async_engine(
        engine.url, pool_size=1, max_overflow=2, pool_use_lifo=True, connect_args=connect_args
    )
    _ping_when_idle(writer, PING_AFTER_IDLE)
    return writer


# A pooled connection used less than this long ago is handed out without a
# ping (see _ping_when_idle).
PING_AFTER_IDLE = 1.0


def _ping_when_idle(engine: AsyncEngine, idle_seconds: float) -> None:
    """Pessimistic disconnect handling at a fraction of pool_pre_ping's cost.

    pool_pre_ping spends a round trip on every checkout: a third of a
    `latest` answer's on PostgreSQL. Here a connection is pinged only when it
    sat idle longer than ``idle_seconds`` (time enough for a network device
    to have dropped it silently); one that asyncpg already knows is closed
    (the server restarted or was cut off) is replaced without asking. What is
    left, a connection that died in the last second without its socket
    saying so, fails its statement, and that invalidates the whole pool
    (SQLAlchemy's disconnect handling): `latest` tries once more and gets a
    fresh connection (latest_answer._read_with_retry); other reads answer
    that one request 503 (retry shortly), and the next gets a fresh one; a
    job in the worker fails that attempt and is retried after its backoff.

    The pools hand out the connection used last (``pool_use_lifo``): with the
    default, the oldest, a pool that once grew to a few connections would
    cycle through all of them under light use (an idle worker's claim every
    half second), each idle past ``idle_seconds`` and pinged every time,
    while the one used last stays warm and the others simply wait."""

    @event.listens_for(engine.sync_engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine.sync_engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop(_IDLE_SINCE, None)
        if idle_since is None:  # just connected
            return
        if known_closed(dbapi_connection):
            raise DisconnectionError("the catalog closed this connection")
        if time.monotonic() - idle_since > idle_seconds:
            try:
                engine.dialect.do_ping(dbapi_connection)
            except Exception as exc:
                raise DisconnectionError(f"ping failed: {exc}") from exc


_IDLE_SINCE = "tierckpt_idle_since"


def known_closed(dbapi_connection: Any) -> bool:
    """The driver already saw this connection end (asyncpg: its socket closed)."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    return driver is not None and bool(driver.is_closed())


def dispose_sync_readers(readers: sessionmaker[Session] | None) -> None:
    """Close the pool of ``create_sync_readers``' engine (None: nothing to do)."""
    bind = readers.kw.get("bind") if readers is not None else None
    if bind is not None:
        bind.engine.dispose()


async def dispose_read_engine(
    read_sessionmaker: async_sessionmaker[AsyncSession], engine: AsyncEngine
) -> None:
    """Close the read engine's pool when it is not ``engine`` itself."""
    bind = read_sessionmaker.kw.get("bind")
    if isinstance(bind, AsyncEngine) and bind.sync_engine.pool is not engine.sync_engine.pool:
        await bind.dispose()


@asynccontextmanager
async def transaction(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> AsyncIterator[AsyncSession]:
    """One unit of work: commit on success, roll back on any error.

    On SQLite its statements run inline on the event loop, holding the
    process's write gate and the database's write lock (sqlite_driver.py):
    keep it short, with no store or file I/O and no await on other work
    inside."""
    async with sessionmaker() as session, session.begin():
        yield session


# Times a transaction gives way, and for how long in all, before it runs to
# the end regardless: under a stream of registrations it must still finish
# (each try lost only the time up to a statement), and a flag that stays
# raised (write_gate.YIELD_MAX) must not make every transaction retry for long.
GIVE_WAY_MAX = 32
GIVE_WAY_SECONDS = 1.0


async def transaction_giving_way(
    sessionmaker: async_sessionmaker[AsyncSession],
    body: Callable[[AsyncSession], Awaitable[T]],
) -> T:
    """``body`` in one ``transaction``, which, in the worker process on
    SQLite, rolls back before its next statement when a registration waits
    for the write lock, and runs again once the registration has it
    (write_gate.py, ``give_way_if_asked``). ``body`` may therefore run more
    than once: it must only read and write the catalog through ``session``
    (no I/O, nothing done outside it that a second run would repeat), and
    its result is the last run's. Anywhere else it is ``transaction``."""
    until = time.monotonic() + GIVE_WAY_SECONDS
    for _ in range(GIVE_WAY_MAX):
        if time.monotonic() > until:
            break
        try:
            with giving_way():
                async with transaction(sessionmaker) as session:
                    return await body(session)
        except OperationalError as exc:
            if not isinstance(exc.orig, GaveWay):
                raise
            metrics.observe_gave_way()
    async with transaction(sessionmaker) as session:
        return await body(session)


def reading(
    sessionmaker: async_sessionmaker[AsyncSession],
) -> async_sessionmaker[AsyncSession]:
    """Sessions on the same catalog for work that only reads, each reading
    one snapshot, so that what it reads in several statements agrees (a
    finished job and the replica it wrote, never one without the other).

    SQLite: a deferred transaction, which in WAL mode reads one snapshot
    without taking the write lock (``_on_begin``); a plain session would take
    it at its first statement and hold it until it ends, stalling every
    writer (the registrations first) meanwhile. PostgreSQL: a READ ONLY
    transaction at REPEATABLE READ, whose snapshot is taken at its first
    statement (at READ COMMITTED, or in the read engine's autocommit, each
    statement reads its own). It takes no lock, and a read-only transaction
    never fails to serialize."""
    bind = sessionmaker.kw.get("bind")
    if not isinstance(bind, AsyncEngine):
        return sessionmaker
    options = bind.sync_engine.get_execution_options()
    if options.get(READ_ONLY) or options.get("postgresql_readonly"):
        return sessionmaker
    readers = _READERS.get(sessionmaker)
    if readers is None:
        if bind.dialect.name == "sqlite":
            snapshot = bind.execution_options(**{READ_ONLY: True})
        elif bind.dialect.name == "postgresql":
            snapshot = bind.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        else:
            return sessionmaker
        readers = _READERS[sessionmaker] = async_sessionmaker(snapshot, expire_on_commit=False)
    return readers


_READERS: weakref.WeakKeyDictionary[
    async_sessionmaker[AsyncSession], async_sessionmaker[AsyncSession]
] = weakref.WeakKeyDictionary()


def dialect_name(session: AsyncSession) -> str:
    bind = session.bind
    if bind is None:
        raise RuntimeError("session is not bound to a catalog engine")
    return bind.dialect.name


def bound_values(columns: Iterable[str]) -> dict[str, BindParameter[Any]]:
    """The SET values of an UPDATE built once and bound per call: each column
    as the parameter ``v_<column>`` (a parameter may not take a column's own
    name there); ``value_params`` binds them."""
    return {column: bindparam(f"v_{column}") for column in columns}


def value_params(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (column -> value) as the parameters of ``bound_values``."""
    return {f"v_{column}": value for column, value in values.items()}
