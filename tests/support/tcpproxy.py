"""A loopback TCP proxy with outage switches, for fault tests.

Put it between the agent and a server (the catalog's PostgreSQL): ``cut()``
drops every open connection and answers each new one by closing it at once
(the server "is gone", as far as the client can tell, without a hang);
``stall()`` is a network partition instead: nothing passes either way, open
connections stay open and new ones are accepted, and every byte is held
(so a client without timeouts waits for ever); ``restore()`` lets
connections through again. It counts what it refused, so a test can tell a
paused client from a busy loop.

It runs its own event loop in a thread, so sync tests, async tests and the
code under test (in any loop) can all use it. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fault proxy listens on loopback only")
        self.target = (target_host, target_port)
        self.host = host
        self.port = 0
        self.accepted = 0  # connections passed through
        self.refused = 0  # connections closed at once while cut
        self._down = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    # -- control (from any thread) -------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def cut(self) -> None:
        """Outage: drop every connection now, refuse new ones until restore()."""
        self._call(self._cut())

    def stall(self) -> None:
        """Partition: hold every byte, in both directions, until restore()."""
        self._call(self._set_flowing(False))

    def restore(self) -> None:
        self._down = False
        self._call(self._set_flowing(True))

    @property
    def down(self) -> bool:
        return self._down

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (in the proxy's loop) ---------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()
        self._down = False
        self._flowing.set()  # held pumps and connections wake up to closed ends

    async def _set_flowing(self, flowing: bool) -> None:
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _cut(self) -> None:
        self._down = True
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            self.refused += 1
            writer.transport.abort()
            return
        await self._flowing.wait()  # a partition: accepted, then nothing
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._open.update((writer, upstream_writer))
        try:
            await asyncio.gather(
                self._pump(reader, upstream_writer), self._pump(upstream_reader, writer)
            )
        finally:
            for end in (writer, upstream_writer):
                self._open.discard(end)
                end.transport.abort()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(1 << 16):
                await self._flowing.wait()  # held while stalled
                sink.write(data)
                await sink.drain()
        # One side finished: end the other so neither waits forever.
        sink.transport.abort()
