"""Shared fixtures: a real SeaweedFS S3 server and real catalog databases.

Fixtures (see each docstring):
- `seaweed` / `seaweed_west` (session): a running `SeaweedServer`; the second
  one is a separate "region" and only starts when a test asks for it.
- `s3_client` (session): a boto3 client on `seaweed`, the independent reader.
- `s3_bucket` (function): name of a fresh, empty bucket on `seaweed`.
- `postgres_admin_url` (session): the server's admin URL, after the
  availability rule (CI: fail, elsewhere: skip).
- `postgres_url` (session): URL of a fresh database, dropped at the end.
- `catalog_url` (function, parametrized sqlite/postgres): URL of an empty
  catalog database for this test.

The PostgreSQL catalog is one database per session (`_catalog_database`),
emptied before each test (`DROP SCHEMA … CASCADE` of every user schema, after
terminating connections a previous test leaked). That is a few
milliseconds per test against ~60 ms (more on a busy CI disk) for
CREATE + DROP DATABASE, and just as isolated, because the catalog lives
entirely in its schemas. Sessions never share it (a random name each), so
parallel sessions (pytest-xdist workers, two checkouts) do not collide.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from devsupport import postgres as pg
from devsupport.seaweed import SeaweedServer, boto3_client
from devsupport.tcpproxy import TcpProxy


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """The session's SeaweedFS server (primary region), started, stopped at the end.

    A test may stop/kill/restart it (same ports and data) but must leave it
    running.
    """
    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture(scope="session")
def seaweed_west(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A second, independent SeaweedFS server: another region."""
    with SeaweedServer(tmp_path_factory.mktemp("seaweed-west")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_client(seaweed: SeaweedServer) -> Any:
    """boto3 S3 client on `seaweed`: reads what the service wrote, independently."""
    return boto3_client(seaweed.endpoint_url)


@pytest.fixture
def s3_bucket(seaweed: SeaweedServer, s3_client: Any) -> Iterator[str]:
    """Name of a new empty bucket on `seaweed`; deleted (with its objects) after the test."""
    name = seaweed.create_bucket(f"test-{uuid.uuid4().hex[:16]}")
    yield name
    # Every SeaweedFS bucket is a collection holding its own volume files;
    # dropping it keeps a long session's server small. Best effort: a test
    # that left the server stopped must not turn into a teardown error here.
    if seaweed.running:
        with contextlib.suppress(Exception):
            s3_client.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """Admin URL of the test PostgreSQL server (TIERCKPT_TEST_POSTGRES_URL).

    Unreachable: the test fails when `CI` is set, is skipped otherwise.
    """
    return pg.require_postgres()


@pytest.fixture(scope="session")
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """SQLAlchemy URL (postgresql+asyncpg) of a fresh database, dropped at session end."""
    with pg.temp_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
def _catalog_database(postgres_admin_url: str) -> Iterator[str]:
    # Separate from postgres_url so that catalog_url's per-test reset never
    # wipes what a test keeps in postgres_url.
    with pg.temp_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def catalog_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """URL of an empty catalog database, once per backend.

    sqlite: a new file in the test's tmp_path. postgres: the session's
    catalog database, emptied before the test (see the module docstring).
    Run one backend with `-k sqlite` / `-m "not postgres"`.
    """
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("_catalog_database")
    pg.reset_database(url)
    return url


@pytest.fixture
def proxied_catalog(postgres_admin_url: str) -> Iterator[tuple[str, TcpProxy]]:
    """A fresh PostgreSQL catalog reached only through a TcpProxy: closing
    the proxy is a catalog outage (test_catalog_outage, test_register_batching)."""
    with pg.temp_database(postgres_admin_url, prefix="tierckpt_outage_") as direct:
        url = make_url(direct)
        with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
            through = url.set(host="127.0.0.1", port=proxy.port)
            yield through.render_as_string(hide_password=False), proxy


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``mount(name, options)``: a new tmpfs under tmp_path mounted with
    ``options`` (a real small or full filesystem); unmounted after the test.
    Needs permission to mount (root): the test is skipped otherwise."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A new directory in /dev/shm (a tmpfs, as the memory tier's default
    arena is), removed after the test; the test is skipped without /dev/shm."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    directory = shm / f"tierckpt-test-{uuid.uuid4().hex}"
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
