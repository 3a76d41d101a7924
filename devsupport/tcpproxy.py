"""A loopback TCP proxy with outage switches, for fault tests.

Put it between the agent and a server (the catalog's PostgreSQL): ``cut()``
drops every open connection and answers each new one by closing it at once
(the server "is gone", as far as the client can tell, without a hang);
``stall()`` is a network partition instead: nothing passes either way, open
connections stay open and new ones are accepted, and every byte is held
(so a client without timeouts waits for ever); ``restore()`` lets
connections through again. It counts what it refused, so a test can tell a
paused client from a busy loop.

It runs its own event loop in a thread (``loopthread``), so sync tests, async tests and the
code under test (in any loop) can all use it. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib

from .loopthread import LoopbackServerThread

__all__ = ["TcpProxy"]


class TcpProxy(LoopbackServerThread):
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self.target = (target_host, target_port)
        self.accepted = 0  # connections passed through
        self.refused = 0  # connections closed at once while cut
        self._down = False
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    # -- control (from any thread) -------------------------------------------

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

    # -- internals (in the proxy's loop) ---------------------------------------

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
