"""Restore over real sockets: the tuned download transport (big reads, idle
connection checks), odd sizes at range boundaries, reused range buffers
(memory bounded), corrupt or broken sources, and nothing left behind.

The objects are served by a small threaded HTTP server with Range support
on 127.0.0.1, so the bytes go through httpx, httpcore, anyio and the kernel
exactly as in a real restore (the fake API tests use httpx.MockTransport).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import hashlib
import http.server
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devsupport.garbage import cyclic_garbage, of_the_client
from tierckpt.client import RestoreError, TransferOptions
from tierckpt.client import _download as download
from tierckpt.client import _download_transport as transport_module
from tierckpt.client import _range_writes as range_writes
from tierckpt.client.models import PlanFile, RestorePlan, RestoreSource
from tierckpt.client.restore import restore_from_plan

RANGE = 4096
OPTIONS = TransferOptions(range_size=RANGE, concurrency=3, window=5, retries=1, retry_backoff=0.001)
# 0 and 1 byte, every range boundary +-1, and a multi-range file.
SIZES = [0, 1, RANGE - 1, RANGE, RANGE + 1, 2 * RANGE - 1, 2 * RANGE, 2 * RANGE + 1, 7 * RANGE + 13]
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def blob(size: int, seed: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}-{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients hanging up mid-answer is what some tests do


class ObjectServer:
    """Objects by path, per region prefix; knobs to corrupt, truncate or
    gzip-label what a region serves."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.corrupt: set[str] = set()  # regions serving a flipped byte
        self.truncate: set[str] = set()  # regions closing the connection mid-body
        self.gzip: set[str] = set()  # regions labelling the body Content-Encoding: gzip
        self.requests: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                region, _, key = self.path.lstrip("/").partition("/")
                header = self.headers.get("Range")
                with owner.lock:
                    owner.requests.append((self.path, header))
                data = owner.objects.get(key)
                if data is None:
                    self.send_error(404)
                    return
                if region in owner.corrupt and data:
                    data = bytes([data[-1] ^ 0xFF]) + data[1:]
                start, end = 0, len(data) - 1
                status = 200
                if header is not None:
                    match = _RANGE.fullmatch(header)
                    assert match is not None, header
                    start, end = int(match[1]), min(int(match[2]), len(data) - 1)
                    status = 206
                body = data[start : end + 1]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                if region in owner.gzip:
                    self.send_header("Content-Encoding", "gzip")
                self.end_headers()
                if region in owner.truncate and len(body) > 1:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def plan(self, regions: list[str], files: dict[str, bytes]) -> RestorePlan:
        self.objects.update(files)
        sources = [
            RestoreSource(
                region=region,
                files=[
                    PlanFile(
                        path=path,
                        size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(),
                        url=f"{self.url}/{region}/{path}",
                    )
                    for path, data in files.items()
                ],
            )
            for region in regions
        ]
        return RestorePlan(run="r", step=1, sources=sources)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[ObjectServer]:
    server = ObjectServer()
    try:
        yield server
    finally:
        server.close()


def odd_files() -> dict[str, bytes]:
    return {f"odd/size-{size:06d}.bin": blob(size, size) for size in SIZES}


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def nothing_left(parent: Path, dest: Path) -> bool:
    return not dest.exists() and not [p for p in parent.iterdir() if ".tierckpt-partial-" in p.name]


@pytest.fixture(params=["httpx", "direct"])
def direct(request: pytest.FixtureRequest) -> bool:
    """Every restore test runs over both readers: httpx with the download
    transport, and the direct reader (``_direct_get``) the clients use."""
    return bool(request.param == "direct")


async def restore(
    plan: RestorePlan, dest: Path, direct: bool, options: TransferOptions = OPTIONS
) -> Path:
    async with httpx.AsyncClient(transport=transport_module.download_transport(options)) as http:
        return await restore_from_plan(
            plan, dest, http=http, token=None, options=options, direct=direct
        )


async def test_odd_sizes_restore_byte_exact_over_the_download_transport(server, tmp_path, direct):
    files = odd_files()
    dest = tmp_path / "dest"
    assert await restore(server.plan(["east"], files), dest, direct) == dest
    assert tree(dest) == files
    # One ranged GET per range, none for the empty file, each range in bounds.
    wanted = sum(-(-size // RANGE) for size in SIZES)
    assert len(server.requests) == wanted
    for path, header in server.requests:
        size = len(files[path.split("/", 2)[2]])
        start, end = map(int, _RANGE.fullmatch(header or "").groups())  # type: ignore[union-attr]
        assert start % RANGE == 0 and end == min(start + RANGE, size) - 1


async def test_a_restore_leaves_no_reference_cycle(server, tmp_path, direct):
    # The collector runs in the trainer's process: neither reader may leave
    # a cycle per ranged GET (httpx binds each response's stream back to it).
    files = odd_files()
    await restore(server.plan(["east"], files), tmp_path / "warm", direct)
    with cyclic_garbage() as found:
        await restore(server.plan(["east"], files), tmp_path / "dest", direct)
    assert tree(tmp_path / "dest") == files
    left = of_the_client(found)
    # Nothing per ranged GET (18 here); per connection, closed with the
    # client, asyncio's transport and its socket (at most 3 connections).
    assert not [name for name in left if name.startswith(("httpx", "httpcore", "tierckpt"))]
    assert max(left.values(), default=0) <= OPTIONS.concurrency, left


async def test_range_buffers_are_reused_and_bounded_by_the_window(
    server, tmp_path, direct, monkeypatch
):
    made: list[int] = []
    original = range_writes.RangeBuffers.take

    def take(self: range_writes.RangeBuffers) -> bytearray:
        if not self._free:
            made.append(self.size)
        return original(self)

    monkeypatch.setattr(range_writes.RangeBuffers, "take", take)
    big = {"big.bin": blob(40 * RANGE + 7, 1), "small.bin": blob(10, 2)}
    await restore(server.plan(["east"], big), tmp_path / "dest", direct)
    assert tree(tmp_path / "dest") == big
    # 42 ranges went through at most `window` buffers of exactly range_size:
    # memory does not grow with the file size.
    assert 1 <= len(made) <= OPTIONS.window
    assert set(made) == {RANGE}


async def test_a_corrupt_region_falls_back_to_the_next(server, tmp_path, direct, caplog):
    files = odd_files()
    server.corrupt.add("east")
    dest = tmp_path / "dest"
    await restore(server.plan(["east", "west"], files), dest, direct)
    assert tree(dest) == files
    assert "SHA-256 mismatch" in caplog.text and "west" in caplog.text


async def test_every_region_corrupt_is_an_error_and_leaves_nothing(server, tmp_path, direct):
    server.corrupt.update({"east", "west"})
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(RestoreError) as raised:
        await restore(server.plan(["east", "west"], odd_files()), dest, direct)
    assert raised.value.code == "all_sources_failed"
    assert "SHA-256 mismatch" in str(raised.value)
    # The parents created for the staging directory went too.
    assert not (tmp_path / "deep").exists()


async def test_connection_dropped_mid_body_falls_back(server, tmp_path, direct):
    files = {"a.bin": blob(3 * RANGE + 1, 3)}
    server.truncate.add("east")
    dest = tmp_path / "dest"
    await restore(server.plan(["east", "west"], files), dest, direct)
    assert tree(dest) == files
    assert any(path.startswith("/west/") for path, _ in server.requests)


async def test_dropped_everywhere_leaves_nothing(server, tmp_path, direct):
    server.truncate.update({"east", "west"})
    dest = tmp_path / "dest"
    with pytest.raises(RestoreError):
        await restore(server.plan(["east", "west"], {"a.bin": blob(3 * RANGE, 4)}), dest, direct)
    assert nothing_left(tmp_path, dest)


async def test_an_encoded_body_is_refused(server, tmp_path, direct):
    server.gzip.add("east")
    files = {"a.bin": blob(RANGE + 3, 5)}
    dest = tmp_path / "dest"
    await restore(server.plan(["east", "west"], files), dest, direct)
    assert tree(dest) == files
    # The bytes were the right ones, but labelled encoded: east is not trusted.
    assert any(path.startswith("/west/") for path, _ in server.requests)


async def test_interrupted_restore_leaves_nothing(server, tmp_path, direct):
    files = {f"f{i}.bin": blob(5 * RANGE + i, i) for i in range(6)}
    plan = server.plan(["east"], files)
    dest = tmp_path / "dest"
    started = asyncio.Event()

    def progress(done: int, total: int) -> None:
        if done:
            started.set()

    async def run() -> None:
        async with httpx.AsyncClient(
            transport=transport_module.download_transport(OPTIONS)
        ) as http:
            await restore_from_plan(
                plan,
                dest,
                http=http,
                token=None,
                options=OPTIONS,
                progress=progress,
                direct=direct,
            )

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert nothing_left(tmp_path, dest)


async def test_idle_connections_are_reused_and_a_closed_one_is_not(server, tmp_path):
    """The download transport answers httpcore's "is this idle connection
    readable?" itself; a connection the server closed must not be reused."""
    transport = transport_module.download_transport(OPTIONS)
    async with httpx.AsyncClient(transport=transport) as http:
        server.objects["x"] = b"hello"
        for _ in range(3):
            response = await http.get(f"{server.url}/east/x")
            assert response.content == b"hello"
        # Truncated answers close the connection server-side.
        server.truncate.add("east")
        with pytest.raises(httpx.HTTPError):
            await http.get(f"{server.url}/east/x")
        server.truncate.clear()
        await asyncio.sleep(0.05)
        response = await http.get(f"{server.url}/east/x")
        assert response.content == b"hello"


def test_download_transport_reads_big_chunks():
    assert transport_module.READ_SIZE >= 256 * 1024
    transport = transport_module.download_transport(TransferOptions(concurrency=12))
    assert isinstance(transport, httpx.AsyncHTTPTransport)
    pool = getattr(transport, "_pool", None)
    if pool is not None:  # the httpx this was written for
        assert pool._max_connections == 12
        assert isinstance(pool._network_backend, transport_module._BigReadBackend)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_is_started_per_range_and_is_only_a_hint(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        range_writes.write_range(fd, b"x" * 3 * RANGE, RANGE)
        assert range_writes.start_writeback(fd, 0, 4 * RANGE) is True
    finally:
        os.close(fd)
    assert target.read_bytes() == bytes(RANGE) + b"x" * 3 * RANGE
    # A closed descriptor: the call fails, nothing is raised (fsync decides).
    assert range_writes.start_writeback(fd, 0, RANGE) is False
    assert range_writes.start_writeback(fd, 0, 0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")
def test_files_are_preallocated_and_a_full_disk_says_so_up_front(tmp_path: Path, monkeypatch):
    target = tmp_path / "f.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        assert range_writes.preallocate(fd, 10 * RANGE) is True
        assert os.fstat(fd).st_size == 10 * RANGE
        assert os.fstat(fd).st_blocks * 512 >= 10 * RANGE  # reserved, not sparse
        assert range_writes.preallocate(fd, 0) is False

        def failing(code: int):  # type: ignore[no-untyped-def]
            def fallocate(*args: object) -> int:
                ctypes.set_errno(code)
                return -1

            return fallocate

        monkeypatch.setattr(range_writes, "_FALLOCATE", failing(errno.EOPNOTSUPP))
        assert range_writes.preallocate(fd, RANGE) is False  # only slower
        monkeypatch.setattr(range_writes, "_FALLOCATE", failing(errno.ENOSPC))
        with pytest.raises(OSError) as raised:
            range_writes.preallocate(fd, RANGE)
        assert raised.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


async def test_no_space_at_preallocation_is_a_clean_error(server, tmp_path, direct, monkeypatch):
    def fallocate(*args: object) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(range_writes, "_FALLOCATE", fallocate)
    dest = tmp_path / "dest"
    with pytest.raises(RestoreError) as raised:
        await restore(server.plan(["east", "west"], {"a.bin": blob(3 * RANGE, 6)}), dest, direct)
    assert raised.value.code == "no_space"
    assert "no space left on the device" in str(raised.value)
    assert nothing_left(tmp_path, dest)
    assert server.requests == []  # refused before a byte was downloaded


def _o_direct_works(directory: Path) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        os.close(os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT | flag, 0o644))
    except OSError:
        return False
    finally:
        (directory / ".probe").unlink(missing_ok=True)
    return True


async def test_ranges_bypass_the_page_cache_where_the_filesystem_allows(
    server, tmp_path, direct, monkeypatch
):
    """Odd sizes (padded last pages, cut back) land byte-exact through
    O_DIRECT; where open refuses O_DIRECT (EINVAL) the same restore is
    buffered; a range size that is not a page multiple is never unbuffered."""
    files = odd_files()
    modes: list[bool] = []
    original = download._Sink.open

    def open_and_note(self: download._Sink) -> None:
        original(self)
        modes.append(self.unbuffered)
        if self.unbuffered:
            assert fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT

    monkeypatch.setattr(download._Sink, "open", open_and_note)
    await restore(server.plan(["east"], files), tmp_path / "a", direct)
    assert tree(tmp_path / "a") == files
    assert set(modes) == {_o_direct_works(tmp_path)}

    modes.clear()
    real_open = os.open

    def refusing(path: object, flags: int, *args: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(range_writes.os, "open", refusing)
    await restore(server.plan(["east"], files), tmp_path / "b", direct)
    assert tree(tmp_path / "b") == files
    assert set(modes) == {False}
    monkeypatch.setattr(range_writes.os, "open", real_open)

    modes.clear()
    unaligned = TransferOptions(range_size=4000, concurrency=3, window=5, retries=1)
    await restore(server.plan(["east"], files), tmp_path / "c", direct, unaligned)
    assert tree(tmp_path / "c") == files
    assert set(modes) == {False}
