"""Asynchronous client of the tierckpt HTTP API (httpx.AsyncClient).

Same calls as :class:`CheckpointClient`, the same flows (``_core``) awaited
on the caller's event loop. A journal is replayed by a background task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from . import _api, _effects
from ._core import ClientCore, public_method
from ._effects import Flow
from ._face import ClientFace
from ._responses import detached
from .restore import restore_from_local

T = TypeVar("T")
P = ParamSpec("P")


def _awaiting(
    flow_method: Callable[Concatenate[ClientCore, P], Flow[T]],
) -> Callable[Concatenate[AsyncCheckpointClient, P], Coroutine[Any, Any, T]]:
    """The public coroutine method that runs ``flow_method``'s flow."""

    async def method(self: AsyncCheckpointClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(flow_method(self, *args, **kwargs))

    return public_method(flow_method, method, "AsyncCheckpointClient")


class AsyncCheckpointClient(ClientFace[httpx.AsyncBaseTransport]):
    """``async with AsyncCheckpointClient(url, token) as c: await c.latest(run)``.

    The settings are :class:`~tierckpt.client._face.ClientFace`'s: ``transport``
    replaces the network (tests, custom TLS) and carries restore downloads
    too unless ``async_transport`` names another; ``transfer`` tunes restore
    downloads. A ``journal`` is replayed by a background task, started with
    the client when created inside a running event loop, else on first use.
    """

    _http: httpx.AsyncClient

    def _open(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(**self._http_options(transport))
        self._replayer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._settled: asyncio.Event | None = None
        if self._journal is not None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass  # started by the first call made inside a loop
            else:
                self._start_replayer()

    def _start_replayer(self) -> None:
        if self._journal is None or self._replayer is not None:
            return
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._replayer = asyncio.get_running_loop().create_task(
            _effects.drive_async(self._replay(), self._perform), name="tierckpt-journal"
        )

    async def __aenter__(self) -> AsyncCheckpointClient:
        self._start_replayer()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections; pending journal entries stay in the file
        (the next client on the same journal replays them)."""
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
            self._replayer = None
        await self._http.aclose()

    register = _awaiting(ClientCore._register)
    get = _awaiting(ClientCore._get)
    list_checkpoints = _awaiting(ClientCore._list_checkpoints)
    runs = _awaiting(ClientCore._runs)
    latest = _awaiting(ClientCore._latest)
    memory_info = _awaiting(ClientCore._memory_info)
    reserve_segment = _awaiting(ClientCore._reserve_segment)
    register_segment = _awaiting(ClientCore._register_segment)
    release_segment = _awaiting(ClientCore._release_segment)
    wait = _awaiting(ClientCore._wait)
    verify = _awaiting(ClientCore._verify)
    restore_plan = _awaiting(ClientCore._restore_plan)
    restore = _awaiting(ClientCore._restore)
    prefetch = _awaiting(ClientCore._prefetch)
    prefetch_jobs = _awaiting(ClientCore._prefetch_jobs)
    lineage = _awaiting(ClientCore._lineage)
    advice = _awaiting(ClientCore._advice)
    flush_journal = _awaiting(ClientCore._flush_journal)

    async def _run(self, flow: Flow[T]) -> T:
        """Run one of the flows of :class:`ClientCore` on this client."""
        self._start_replayer()
        return await _effects.drive_async(flow, self._perform)

    async def _perform(self, request: _effects.Effect) -> Any:
        match request:
            case _effects.Http(call):
                return detached(await self._http.request(**_api.request_args(call, self._token)))
            case _effects.Sleep(seconds):
                await asyncio.sleep(seconds)
            case _effects.Download() as download:
                return await self._download(download)
            case _effects.CopyLocal(checkpoint, dest, rank, progress):
                return await asyncio.to_thread(
                    restore_from_local, checkpoint, dest, rank=rank, progress=progress
                )
            case _effects.ReplayTurn():
                return True  # aclose() cancels the replayer instead
            case _effects.ReplayIdle():
                assert self._wake is not None
                await self._wake.wait()
                self._wake.clear()
            case _effects.JournalAppended():
                assert self._wake is not None
                self._wake.set()
            case _effects.JournalSettled():
                assert self._settled is not None
                self._settled.set()
            case _effects.JournalChange(timeout):
                assert self._settled is not None and self._journal is not None
                # Cleared before looking: a settle after this point is seen.
                self._settled.clear()
                if len(self._journal):
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(timeout):
                            await self._settled.wait()
            case _:
                raise TypeError(f"not a request of a client flow: {request!r}")
        return None
