"""The direct range reader (``_direct_get``) against a scripted HTTP server:
keep-alive reuse, servers closing idle connections, answers it must refuse
(wrong length, error status, huge head, silence) or hand over to httpx
(chunked framing), proxies, TLS, and never a secret in a message.

Each test scripts what the server answers, on real sockets, so the bytes go
through the event loop's BufferedProtocol path exactly as in a restore.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from tierckpt.client import TransferOptions
from tierckpt.client import _direct_get as direct_get
from tierckpt.client import _download as download

DATA = bytes(range(256)) * 64  # 16 KiB
SECRET = "X-Amz-Signature=0123456789abcdef"

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, str]], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> dict[str, str] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    request = {"request-line": lines[0]}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            request[name.strip().lower()] = value.strip()
    return request


def requested_range(request: dict[str, str]) -> tuple[int, int]:
    first, last = request["range"].removeprefix("bytes=").split("-")
    return int(first), int(last) + 1


async def serve_range(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: dict[str, str],
    extra: str = "",
) -> None:
    start, end = requested_range(request)
    body = DATA[start:end]
    writer.write(
        f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
        f"Content-Range: bytes {start}-{end - 1}/{len(DATA)}\r\n{extra}\r\n".encode()
        + body
    )
    await writer.drain()


class Scripted:
    """A server whose connections each run ``answer`` per request."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[dict[str, str]] = []
        self.server: asyncio.AbstractServer | None = None
        self.ssl: ssl.SSLContext | None = None

    async def start(self, tls: ssl.SSLContext | None = None) -> Scripted:
        self.ssl = tls
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=tls)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def url(self, path: str = "/bucket/key") -> str:
        scheme = "https" if self.ssl else "http"
        return f"{scheme}://127.0.0.1:{self.port}{path}?{SECRET}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while (request := await read_request(reader)) is not None:
                self.requests.append(request)
                await self.answer(reader, writer, request)
                if writer.is_closing():
                    break
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Answer], Awaitable[Scripted]]]:
    servers: list[Scripted] = []

    async def make(answer: Answer) -> Scripted:
        server = await Scripted(answer).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


def reader(read_timeout: float | None = 5.0) -> direct_get.DirectRanges:
    return direct_get.DirectRanges(connect_timeout=5.0, read_timeout=read_timeout)


async def fetch(ranges: direct_get.DirectRanges, url: str, start: int, end: int) -> bytes:
    buffer = bytearray(end - start)
    await ranges.get_into(url, {}, len(DATA), start, end, buffer)
    return bytes(buffer)


async def test_ranges_arrive_byte_exact_over_one_kept_alive_connection(scripted):
    server = await scripted(serve_range)
    async with reader() as ranges:
        for start in range(0, len(DATA), 3000):
            end = min(start + 3000, len(DATA))
            assert await fetch(ranges, server.url(), start, end) == DATA[start:end]
    assert server.connections == 1
    request = server.requests[0]
    assert request["request-line"] == f"GET /bucket/key?{SECRET} HTTP/1.1"
    assert request["host"] == f"127.0.0.1:{server.port}"
    assert request["accept-encoding"] == "identity"


async def test_a_connection_the_server_closed_while_idle_is_replaced_unnoticed(scripted):
    async def once(reader, writer, request):
        await serve_range(reader, writer, request)
        writer.close()  # keep-alive refused after the fact, without saying so

    server = await scripted(once)
    async with reader() as ranges:
        assert await fetch(ranges, server.url(), 0, 100) == DATA[:100]
        await asyncio.sleep(0.05)
        assert await fetch(ranges, server.url(), 100, 200) == DATA[100:200]
    assert server.connections == 2


async def test_connection_close_is_honoured(scripted):
    async def closing(reader, writer, request):
        await serve_range(reader, writer, request, extra="Connection: close\r\n")

    server = await scripted(closing)
    async with reader() as ranges:
        for start in (0, 10, 20):
            assert await fetch(ranges, server.url(), start, start + 10) == DATA[start : start + 10]
        assert not any(ranges._idle.values())
    assert server.connections == 3


async def test_an_error_status_is_a_source_error_and_its_body_is_dropped(scripted):
    async def unavailable(reader, writer, request):
        body = b"<Error><Code>SlowDown</Code></Error>"
        writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    server = await scripted(unavailable)
    async with reader() as ranges:
        with pytest.raises(download.SourceError) as raised:
            await fetch(ranges, server.url(), 0, 100)
    assert raised.value.retryable
    assert "answered HTTP 503" in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    "head, message, retryable",
    [
        (b"HTTP/1.1 206 OK\r\nContent-Length: 5\r\n\r\nhello", "answered 5 bytes", False),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + DATA[:100],
            "ignored the Range",
            False,
        ),
        (
            b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\nContent-Range: bytes 5-104/16384\r\n\r\n"
            + DATA[5:105],
            "wrong range",
            False,
        ),
        (
            b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/99999\r\n\r\n"
            + DATA[:100],
            "the plan says",
            False,
        ),
        (
            b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\nContent-Range: bytes 0-99/16384\r\n"
            b"Content-Encoding: gzip\r\n\r\n" + DATA[:100],
            "Content-Encoding gzip",
            False,
        ),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x answer", True),
        (b"HTTP/1.1 206 OK\r\nX-Filler: " + b"a" * 70_000 + b"\r\n\r\n", "head too large", False),
        (
            b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\n\r\n" + DATA[:40],
            "closed the connection",
            True,
        ),
    ],
    ids=["length", "no-range", "wrong-range", "size", "encoded", "not-http", "huge-head", "cut"],
)
async def test_wrong_answers_are_refused(scripted, head, message, retryable):
    async def wrong(reader, writer, request):
        writer.write(head)
        await writer.drain()
        if message == "closed the connection":
            writer.close()

    server = await scripted(wrong)
    async with reader() as ranges:
        with pytest.raises(download.SourceError) as raised:
            await fetch(ranges, server.url(), 0, 100)
        assert not any(ranges._idle.values())  # never reused after that
    assert message in str(raised.value)
    assert raised.value.retryable is retryable
    assert SECRET not in str(raised.value)


async def test_silence_times_out(scripted):
    async def stall(reader, writer, request):
        writer.write(b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\n\r\n" + DATA[:10])
        await writer.drain()
        await asyncio.sleep(30)

    server = await scripted(stall)
    async with reader(read_timeout=0.3) as ranges:
        with pytest.raises(download.SourceError) as raised:
            await asyncio.wait_for(fetch(ranges, server.url(), 0, 100), 10)
    assert "no bytes for 0.3 s" in str(raised.value) and raised.value.retryable


async def test_a_slow_but_steady_body_is_not_a_timeout(scripted):
    async def trickle(reader, writer, request):
        start, end = requested_range(request)
        writer.write(b"HTTP/1.1 206 OK\r\nContent-Length: %d\r\n" % (end - start))
        writer.write(b"Content-Range: bytes %d-%d/%d\r\n\r\n" % (start, end - 1, len(DATA)))
        for offset in range(start, end, 10):
            writer.write(DATA[offset : min(offset + 10, end)])
            await writer.drain()
            await asyncio.sleep(0.05)

    server = await scripted(trickle)
    async with reader(read_timeout=0.2) as ranges:
        assert await fetch(ranges, server.url(), 0, 100) == DATA[:100]


async def test_a_cancelled_read_closes_its_connection(scripted):
    async def stall(reader, writer, request):
        writer.write(b"HTTP/1.1 206 OK\r\nContent-Length: 100\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    server = await scripted(stall)
    async with reader() as ranges:
        buffer = bytearray(100)
        task = asyncio.create_task(ranges.get_into(server.url(), {}, len(DATA), 0, 100, buffer))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(ranges._idle.values())
    # Nothing may land in the buffer once the read was given up.
    assert buffer == bytearray(100)


async def test_chunked_answers_go_through_httpx(scripted, tmp_path):
    async def chunked(reader, writer, request):
        start, end = requested_range(request)
        body = DATA[start:end]
        writer.write(
            b"HTTP/1.1 206 OK\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Range: bytes %d-%d/%d\r\n\r\n"
            % (start, end - 1, len(DATA))
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
        await writer.drain()

    server = await scripted(chunked)
    options = TransferOptions(range_size=4096, concurrency=2, window=4, retries=0)
    job = download.FileJob(
        url=server.url(),
        target=tmp_path / "f.bin",
        size=len(DATA),
        sha256=hashlib.sha256(DATA).hexdigest(),
        label="f.bin",
        headers={},
    )
    async with httpx.AsyncClient() as http, reader() as ranges:
        with pytest.raises(download.Unsupported):
            await fetch(ranges, server.url(), 0, 100)
        await download.fetch_files(http, [job], options=options, direct=ranges)
        assert not ranges.accepts(server.url())  # the host goes through httpx now
    assert job.target.read_bytes() == DATA
    agents = {request.get("user-agent", "") for request in server.requests}
    assert any("httpx" in agent for agent in agents)


def test_only_plain_absolute_urls_that_no_proxy_takes(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    ranges = reader()
    assert ranges.accepts("http://store:9000/b/k?X-Amz-Signature=1")
    assert ranges.accepts("https://store/b/k")
    assert not ranges.accepts("/v1/objects/run/1/x")  # the service's own endpoint
    assert not ranges.accepts("ftp://store/b/k")

    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example")
    ranges = reader()
    assert not ranges.accepts("http://store:9000/b/k")
    assert ranges.accepts("https://store/b/k")  # no proxy for https
    assert ranges.accepts("http://internal.example/b/k")


def test_headers_cannot_split_the_request():
    ranges = reader()
    with pytest.raises(download.SourceError):
        direct_get.DirectRanges._request(
            direct_get._target("http://store/b/k"), {"Authorization": "x\r\nEvil: 1"}, 0, 10
        )
    assert ranges.accepts("http://store/b/k%0D%0AEvil:%201")  # percent-encoded, harmless


@pytest.fixture
def tls_context(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a fresh self-signed certificate for 127.0.0.1,
    and a client context trusting only it."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl (Debian's, on every machine here) is needed for the TLS test"
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    return server, client


async def test_tls(tls_context, monkeypatch):
    server_context, client_context = tls_context
    monkeypatch.setattr(direct_get, "ssl_context", lambda: client_context)
    server = await Scripted(serve_range).start(tls=server_context)
    try:
        async with reader() as ranges:
            for start in (0, 5000, 10000):
                got = await fetch(ranges, server.url(), start, start + 5000)
                assert got == DATA[start : start + 5000]
        assert server.connections == 1
        # An unknown certificate is refused.
        monkeypatch.setattr(direct_get, "ssl_context", lambda: ssl.create_default_context())
        async with reader() as ranges:
            with pytest.raises(download.SourceError) as raised:
                await fetch(ranges, server.url(), 0, 10)
        assert "CERTIFICATE_VERIFY_FAILED" in str(raised.value)
    finally:
        await server.stop()
