"""Synchronous client of the tierckpt HTTP API (httpx.Client).

Same calls as :class:`AsyncCheckpointClient`, the same flows (``_core``)
performed with blocking I/O. Only ``restore`` runs an event loop, to reuse
the parallel downloader. A journal is replayed by a background thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from . import _api, _effects
from ._closing import ClosesOnExit
from ._core import ClientCore, public_method
from ._effects import Flow
from ._face import ClientFace
from ._responses import detached
from .restore import restore_from_local

T = TypeVar("T")
P = ParamSpec("P")


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a dependency on CPython/POSIX):
    its socket reads and writes cost less CPU than asyncio's (the client's
    own loop; an async caller keeps whatever loop it runs)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with asyncio.Runner(loop_factory=_new_event_loop) as runner:
        return runner.run(make())


def _run_blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code, even when the
    caller already sits inside an event loop (a notebook, an async app)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(make)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierckpt-restore") as pool:
        return pool.submit(_run, make).result()


def _blocking(
    flow_method: Callable[Concatenate[ClientCore, P], Flow[T]],
) -> Callable[Concatenate[CheckpointClient, P], T]:
    """The public, blocking method that runs ``flow_method``'s flow."""

    def method(self: CheckpointClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(flow_method(self, *args, **kwargs))

    return public_method(flow_method, method, "CheckpointClient")


class CheckpointClient(ClosesOnExit, ClientFace[httpx.BaseTransport]):
    """``with CheckpointClient(url, token) as c: c.register(run, step, path)``.

    The settings are :class:`~tierckpt.client._face.ClientFace`'s: ``transport``
    replaces the network for API calls, ``async_transport`` for restore
    downloads (defaults to ``transport`` when it can serve both, as
    ``httpx.MockTransport`` does), ``transfer`` tunes restore downloads, and
    a ``journal`` is replayed by a background thread.
    """

    _http: httpx.Client

    def _open(self, transport: httpx.BaseTransport | None) -> None:
        self._http = httpx.Client(**self._http_options(transport))
        self._replayer: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        # Notified when the replayer settles an entry; shares the journal lock.
        self._settled = threading.Condition(self._journal_lock)
        if self._journal is not None:
            self._replayer = threading.Thread(
                target=_effects.drive,
                args=(self._replay(), self._perform_replay),
                name="tierckpt-journal",
                daemon=True,
            )
            self._replayer.start()

    def close(self) -> None:
        """Close the connections; pending journal entries stay in the file
        (the next client on the same journal replays them)."""
        if self._replayer is not None:
            self._stop.set()
            self._wake.set()
            self._replayer.join(self._timeout + 5)
        self._http.close()

    register = _blocking(ClientCore._register)
    get = _blocking(ClientCore._get)
    list_checkpoints = _blocking(ClientCore._list_checkpoints)
    runs = _blocking(ClientCore._runs)
    latest = _blocking(ClientCore._latest)
    memory_info = _blocking(ClientCore._memory_info)
    reserve_segment = _blocking(ClientCore._reserve_segment)
    register_segment = _blocking(ClientCore._register_segment)
    release_segment = _blocking(ClientCore._release_segment)
    wait = _blocking(ClientCore._wait)
    verify = _blocking(ClientCore._verify)
    restore_plan = _blocking(ClientCore._restore_plan)
    restore = _blocking(ClientCore._restore)
    prefetch = _blocking(ClientCore._prefetch)
    prefetch_jobs = _blocking(ClientCore._prefetch_jobs)
    lineage = _blocking(ClientCore._lineage)
    advice = _blocking(ClientCore._advice)
    flush_journal = _blocking(ClientCore._flush_journal)

    def _run(self, flow: Flow[T]) -> T:
        """Run one of the flows of :class:`ClientCore` on this client."""
        return _effects.drive(flow, self._perform)

    def _perform(self, request: _effects.Effect) -> Any:
        match request:
            case _effects.Http(call):
                return detached(self._http.request(**_api.request_args(call, self._token)))
            case _effects.Sleep(seconds):
                time.sleep(seconds)
            case _effects.Download() as download:
                return _run_blocking(lambda: self._download(download))
            case _effects.CopyLocal(checkpoint, dest, rank, progress):
                return restore_from_local(checkpoint, dest, rank=rank, progress=progress)
            case _effects.JournalAppended():
                self._wake.set()
            case _effects.JournalChange(timeout):
                with self._settled:
                    # Checked under the lock the replayer settles under: an
                    # entry settled since the flow looked is not waited for.
                    if self._journal is not None and len(self._journal):
                        self._settled.wait(timeout)
            case _:
                raise TypeError(f"not a request of a client flow: {request!r}")
        return None

    def _perform_replay(self, request: _effects.Effect) -> Any:
        """The replayer thread's requests: it stops at its next turn once
        the client closes, and close() cuts its backoff short."""
        match request:
            case _effects.ReplayTurn():
                return not self._stop.is_set()
            case _effects.ReplayIdle():
                self._wake.wait()
                self._wake.clear()
            case _effects.Sleep(seconds):
                self._stop.wait(seconds)
            case _effects.JournalSettled():
                with self._settled:
                    self._settled.notify_all()
            case _:
                return self._perform(request)
        return None
