"""Throw-away PostgreSQL databases for the catalog tests.

The server comes from `TIERCKPT_TEST_POSTGRES_URL` (a SQLAlchemy URL; default
the local server on 5432). Helpers here create a uniquely named database on
it, hand back its SQLAlchemy URL, empty it between tests and drop it.

The availability rule lives here too (`require_postgres`): under CI (the `CI`
environment variable set) an unreachable server fails the test, because a
silently skipped catalog backend is a hole in the build; on a developer's
machine it is a skip that says how to point the tests at a server.

Plain functions, callable from sync fixtures and from code already inside an
event loop: each runs its asyncpg work on a private loop in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import TypeVar

import asyncpg
from sqlalchemy.engine import URL, make_url

__all__ = [
    "DEFAULT_ADMIN_URL",
    "asyncpg_dsn",
    "create_temp_database",
    "database_url",
    "drop_database",
    "in_ci",
    "postgres_admin_url",
    "postgres_available",
    "require_postgres",
    "reset_database",
    "temp_database",
]

DEFAULT_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
ENV_VAR = "TIERCKPT_TEST_POSTGRES_URL"
TEMP_PREFIX = "tierckpt_test_"
CONNECT_TIMEOUT = 5.0
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

T = TypeVar("T")


def postgres_admin_url() -> str:
    """SQLAlchemy URL of a database we may connect to in order to create others."""
    return os.environ.get(ENV_VAR) or DEFAULT_ADMIN_URL


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def database_url(name: str, admin_url: str | None = None) -> str:
    """The SQLAlchemy (asyncpg) URL of database `name` on the admin URL's server."""
    url = make_url(admin_url or postgres_admin_url()).set(
        drivername="postgresql+asyncpg", database=name
    )
    return url.render_as_string(hide_password=False)


def asyncpg_dsn(sqlalchemy_url: str) -> str:
    """The same URL as a plain libpq DSN, for asyncpg.connect()."""
    url: URL = make_url(sqlalchemy_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def _on(sqlalchemy_url: str, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """Run `work` on one connection to the database, closed afterwards, and
    wait for its result; callable from sync code and from inside a loop."""

    async def connected() -> T:
        conn = await asyncpg.connect(asyncpg_dsn(sqlalchemy_url), timeout=CONNECT_TIMEOUT)
        try:
            return await work(conn)
        finally:
            await conn.close()

    # asyncio.run() refuses to nest inside a running loop (async fixtures and
    # tests run inside pytest-asyncio's), so always use a fresh thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierckpt-pg") as pool:
        return pool.submit(lambda: asyncio.run(connected())).result()


def _check_name(name: str) -> str:
    # Names are spliced into DDL (identifiers cannot be bound parameters).
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a safe database name: {name!r}")
    return name


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


@lru_cache(maxsize=8)
def _probe(admin_url: str) -> str | None:
    """None when the server answers, else why not (cached: one probe per URL)."""

    try:
        _on(admin_url, lambda conn: conn.fetchval("SELECT 1"))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def postgres_available(admin_url: str | None = None) -> bool:
    return _probe(admin_url or postgres_admin_url()) is None


def require_postgres(admin_url: str | None = None) -> str:
    """Return the admin URL, or fail (CI) / skip (elsewhere) the calling test."""
    import pytest

    url = admin_url or postgres_admin_url()
    problem = _probe(url)
    if problem is None:
        return url
    shown = make_url(url).render_as_string(hide_password=True)
    if in_ci():
        pytest.fail(
            f"PostgreSQL at {shown} is unreachable ({problem}) and CI is set: the "
            f"PostgreSQL catalog tests must run in CI. Start the server or set {ENV_VAR}.",
            pytrace=False,
        )
    pytest.skip(
        f"PostgreSQL at {shown} is unreachable ({problem}); start one or set "
        f"{ENV_VAR}=postgresql+asyncpg://user:pass@host:port/db to run these tests"
    )


def create_temp_database(admin_url: str | None = None, prefix: str = TEMP_PREFIX) -> str:
    """Create `<prefix><random>` and return its SQLAlchemy URL."""
    admin = admin_url or postgres_admin_url()
    name = _check_name(f"{prefix}{uuid.uuid4().hex[:12]}")

    # template0: a clean database even if template1 was customised.
    _on(admin, lambda conn: conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0'))
    return database_url(name, admin)


def drop_database(name_or_url: str, admin_url: str | None = None) -> None:
    """Drop a database (by name or by its URL), closing whatever still uses it."""
    admin = admin_url or postgres_admin_url()
    name = make_url(name_or_url).database if "://" in name_or_url else name_or_url
    if not name:
        raise ValueError(f"no database name in {name_or_url!r}")
    _check_name(name)
    if name == make_url(admin).database:
        raise ValueError(f"refusing to drop the admin database {name!r}")

    # FORCE (PostgreSQL >= 13): a leaked pool in a test must not block the drop.
    _on(admin, lambda conn: conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def terminate_connections(url: str) -> int:
    """End every other session on ``url``'s database, as a restart of the
    server or an operator's pg_terminate_backend would; how many were ended."""

    async def terminate(conn: asyncpg.Connection) -> int:
        ended = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(ended)

    return _on(url, terminate)


def transaction_count(name_or_url: str, admin_url: str | None = None) -> int:
    """Commits + rollbacks of a database so far (``pg_stat_database``: each
    session reports its own at the end of a transaction at most once a
    second, and within ten seconds of going idle). Read from the admin
    database, so that the reading adds nothing to the count."""
    admin = admin_url or postgres_admin_url()
    name = make_url(name_or_url).database if "://" in name_or_url else name_or_url

    async def count(conn: asyncpg.Connection) -> int:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value = await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1", name
        )
        return int(value)

    return _on(admin, count)


@contextlib.contextmanager
def temp_database(admin_url: str | None = None, prefix: str = TEMP_PREFIX) -> Iterator[str]:
    """A new database (`create_temp_database`) for the `with` block, dropped after it."""
    admin = admin_url or postgres_admin_url()
    url = create_temp_database(admin, prefix)
    try:
        yield url
    finally:
        drop_database(url, admin)


def reset_database(url: str) -> None:
    """Empty a database in place: every non-system schema dropped, `public` recreated.

    A few milliseconds, against ~30-60 ms for CREATE + DROP DATABASE (and far
    more on a busy CI disk). Other sessions on it are terminated first: a
    connection left open by the previous test would otherwise hold locks
    that make DROP SCHEMA wait forever.
    """

    async def reset(conn: asyncpg.Connection) -> None:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        schemas = await conn.fetch(
            "SELECT nspname FROM pg_namespace "
            "WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
        )
        statements = [f"DROP SCHEMA {_quote(row['nspname'])} CASCADE" for row in schemas]
        statements.append("CREATE SCHEMA public")
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement)

    _on(url, reset)
