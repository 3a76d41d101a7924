"""A loopback server that runs its own event loop in a daemon thread.

The fault proxies (`tcpproxy.TcpProxy`, `s3proxy.S3FaultProxy`) sit between
the code under test and a real server. The code under test may be sync or
async, and an async test may block its own loop while the proxy must keep
serving, so each proxy owns a loop in a thread and is controlled from any
thread: `start()` / `close()` (or `with`), and `_call()` to run one of its
coroutines on its loop and wait for the result.

Subclasses implement `_start()` (listen on `self.host`, set `self.port`) and
`_close()` (stop serving, drop what is open); both run on the proxy's loop.
They listen on loopback only: a fault proxy is never reachable from outside.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

T = TypeVar("T")

__all__ = ["LoopbackServerThread"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LoopbackServerThread:
    def __init__(self, host: str = "127.0.0.1") -> None:
        if host not in LOOPBACK:
            raise ValueError("the fault proxy listens on loopback only")
        self.host = host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- control (from any thread) -------------------------------------------

    def start(self) -> Self:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._close())
            # Connections still being served end here, not as tasks destroyed
            # pending when the loop is gone (a warning in whichever test
            # happens to collect them).
            self._call(self._finish_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    async def _finish_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the server itself (in the loop) ---------------------------------------

    async def _start(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError
