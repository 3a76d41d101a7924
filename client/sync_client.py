"""Synchronous client of the tierckpt HTTP API (httpx.Client).

Same methods as :class:`AsyncCheckpointClient`, built from the same request
descriptions in ``_api``. Only ``restore`` runs an event loop, to reuse the
parallel downloader.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx

from . import _api
from . import journal as _journal
from ._api import DEFAULT_URL, USER_AGENT, Call, FilesLike, ParentLike
from ._download import TransferOptions, download_transport
from .errors import NotFoundError, ServerError, error_from_transport
from .models import Advice, Checkpoint, CheckpointRef, Lineage, RestorePlan, RunSummary
from .restore import Progress, check_destination, restore_from_plan

T = TypeVar("T")

log = logging.getLogger("tierckpt.client.journal")


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a dependency on CPython/POSIX):
    a restore's socket reads and writes then cost ~8 % less CPU (the
    client's own loop; an async caller keeps whatever loop it runs)."""
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


class CheckpointClient:
    """``with CheckpointClient(url, token) as c: c.register(run, step, path)``.

    ``transport`` replaces the network for API calls; ``async_transport`` for
    restore downloads (defaults to ``transport`` when it can serve both, as
    ``httpx.MockTransport`` does). ``transfer`` tunes restore downloads.

    ``journal`` (a file path) makes ``register`` survive an unreachable
    service: the registration is kept in that local journal and replayed by a
    background thread (see :mod:`tierckpt.client.journal`).
    """

    _restored: CheckpointRef | None = None

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        retries: int = _api.RETRY_ATTEMPTS,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        transfer: TransferOptions | None = None,
        journal: str | os.PathLike[str] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        # 429/503/connection refused are retried with backoff this many times.
        self.retries = retries
        self._token = token
        self._timeout = timeout
        self._transfer = transfer or TransferOptions()
        if async_transport is None and isinstance(transport, httpx.AsyncBaseTransport):
            async_transport = transport
        self._async_transport = async_transport
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers={"User-Agent": USER_AGENT},
        )
        self._journal: _journal.RegistrationJournal | None = None
        self._replayer: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._changed = threading.Condition()
        self._replayed = 0
        if journal is not None:
            self._journal = _journal.RegistrationJournal(journal)
            self._replayer = threading.Thread(
                target=self._replay_loop, name="tierckpt-journal", daemon=True
            )
            self._replayer.start()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections; pending journal entries stay in the file
        (the next client on the same journal replays them)."""
        if self._replayer is not None:
            self._stop.set()
            self._wake.set()
            self._replayer.join(self._timeout + 5)
        self._http.close()

    def _replay_loop(self) -> None:
        assert self._journal is not None
        delay = _journal.BACKOFF_START
        while not self._stop.is_set():
            entries = self._journal.entries()
            if not entries:
                self._wake.wait()
                self._wake.clear()
                continue
            entry_id, body = entries[0]
            response: httpx.Response | None
            try:
                response = self._http.request(
                    **_api.request_args(
                        _api.Call("POST", "/v1/checkpoints", dict, body=body), self._token
                    )
                )
            except Exception:  # the service is down, or this client is closing
                response = None
            outcome = _journal.replay_outcome(response)
            if outcome == "retry":
                self._stop.wait(delay)
                delay = _journal.next_backoff(delay)
                continue
            delay = _journal.BACKOFF_START
            if outcome == "drop":
                assert response is not None
                log.warning(
                    "dropping journaled registration of %s: the service refused it (%s)",
                    _journal.describe(body),
                    _api.error_from_response(response),
                )
            with self._changed:  # flush_journal reads both under this lock
                self._journal.mark_done(entry_id)
                if outcome == "done":
                    self._replayed += 1
                self._changed.notify_all()

    def flush_journal(self, timeout: float | None = None) -> int:
        """Wait until every journaled registration reached the service;
        returns how many were replayed (accepted) since the last flush.
        Refused ones (4xx) are dropped with a warning and not counted.
        Raises TimeoutError after ``timeout`` seconds."""
        if self._journal is None:
            return 0
        deadline = _api.wait_deadline(timeout)
        with self._changed:
            while len(self._journal):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{len(self._journal)} journaled registrations still pending "
                        f"after {timeout} s"
                    )
                self._changed.wait(0.5 if remaining is None else min(0.5, remaining))
            replayed, self._replayed = self._replayed, 0
        return replayed

    def _send(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            try:
                response = self._http.request(**_api.request_args(call, self._token))
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                delay = _api.retry_after(None, attempt, self.retries)
                if delay is None:
                    raise error_from_transport(exc, self.base_url) from exc
            except httpx.RequestError as exc:
                raise error_from_transport(exc, self.base_url) from exc
            else:
                delay = _api.retry_after(response, attempt, self.retries)
                if delay is None:
                    return _api.parse_response(call, response)
            attempt += 1
            time.sleep(delay)

    def register(
        self,
        run: str,
        step: int,
        path: str | os.PathLike[str],
        rank: int = 0,
        world_size: int = 1,
        metrics: Mapping[str, float] | None = None,
        parent: ParentLike | _api._AutoParent = _api.AUTO_PARENT,
        priority: str = "normal",
        epoch: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        files: FilesLike = None,
        write_seconds: float | None = None,
    ) -> Checkpoint:
        """Register a checkpoint written at ``path``; returns at once (202).

        ``parent`` defaults to the checkpoint this client restored last (then
        forgotten); pass None for no parent.

        With a ``journal``, an unreachable service (no answer, timeout, 503)
        does not raise: the registration is journaled and the returned
        Checkpoint has ``state="pending_registration"`` until the background
        replay registers it (``flush_journal`` waits for that). A 4xx still
        raises at once."""
        if isinstance(parent, _api._AutoParent):
            parent, self._restored = self._restored, None
        call = _api.register(
            run,
            step,
            path,
            rank=rank,
            world_size=world_size,
            metrics=metrics,
            parent=parent,
            priority=priority,
            epoch=epoch,
            metadata=metadata,
            files=files,
            write_seconds=write_seconds,
        )
        if self._journal is None:
            return self._send(call)
        try:
            return self._send(call)
        except ServerError as exc:
            if not _journal.should_journal(exc):
                raise
            self._journal.append(call.body)
            self._wake.set()
            log.warning(
                "journaled registration of %s: %s", _journal.describe(call.body), exc.message
            )
            return _journal.pending_checkpoint(call.body)

    def get(self, run: str, step: int) -> Checkpoint:
        return self._send(_api.get(run, step))

    def list_checkpoints(
        self,
        run: str,
        state: str | None = None,
        min_step: int | None = None,
        max_step: int | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[Checkpoint]:
        """Checkpoints of ``run``, newest step first, without their file lists."""
        call = _api.list_checkpoints(
            run, state=state, min_step=min_step, max_step=max_step, limit=limit, offset=offset
        )
        return self._send(call)

    def runs(self, limit: int | None = None, offset: int | None = None) -> list[RunSummary]:
        return self._send(_api.runs(limit=limit, offset=offset))

    def latest(
        self, run: str, region: str | None = None, node: str | None = None
    ) -> Checkpoint | None:
        """The latest valid checkpoint of ``run`` with its locations, or None."""
        return self._send(_api.latest(run, region=region, node=node))

    def wait(
        self,
        run: str,
        step: int,
        state: str = "durable",
        timeout: float | None = None,
        poll_interval: float = 0.2,
    ) -> Checkpoint:
        """Poll until the checkpoint reaches at least ``state``.

        Raises CheckpointFailedError if it ends failed/corrupt/deleted and
        TimeoutError after ``timeout`` seconds.
        """
        target = _api.check_wait_target(state)
        deadline = _api.wait_deadline(timeout)
        while True:
            checkpoint = self.get(run, step)
            if _api.wait_reached(checkpoint, target):
                return checkpoint
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                raise _api.wait_timeout_error(run, step, state, checkpoint, timeout)
            time.sleep(delay)

    def verify(
        self, run: str, step: int, timeout: float | None = None, poll_interval: float = 0.2
    ) -> Checkpoint:
        """Re-read and re-hash every region's copy; returns once the
        verification jobs have finished, with the per-region outcome."""
        self._send(_api.verify(run, step))
        deadline = _api.wait_deadline(timeout)
        while True:
            checkpoint = self.get(run, step)
            if not checkpoint.verifying:
                return checkpoint
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                raise TimeoutError(f"verification of {run}:{step} still running after {timeout} s")
            time.sleep(delay)

    def restore_plan(
        self, run: str, step: int | None = None, region: str | None = None, rank: int | None = None
    ) -> RestorePlan:
        """Where each file of a checkpoint can be downloaded from; ``step``
        defaults to the latest valid checkpoint."""
        if step is None:
            latest = self.latest(run, region=region)
            if latest is None:
                raise NotFoundError(
                    f"run {run} has no valid checkpoint", code="no_valid_checkpoint"
                )
            step = latest.step
        return self._send(_api.restore_plan(run, step, region=region, rank=rank))

    def restore(
        self,
        run: str,
        dest: str | os.PathLike[str],
        step: int | None = None,
        region: str | None = None,
        rank: int | None = None,
        progress: Progress | None = None,
    ) -> Path:
        """Download and verify a checkpoint into ``dest`` (which must not exist
        or be empty); returns ``dest``. Falls back across regions."""
        check_destination(dest)
        plan = self.restore_plan(run, step, region=region, rank=rank)

        async def download() -> Path:
            http = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=self._timeout,
                transport=self._async_transport or download_transport(self._transfer),
                headers={"User-Agent": USER_AGENT},
            )
            try:
                return await restore_from_plan(
                    plan,
                    dest,
                    http=http,
                    token=self._token,
                    rank=rank,
                    progress=progress,
                    options=self._transfer,
                    direct=self._async_transport is None,
                )
            finally:
                # Closing the client closes its transport; one passed in by the
                # caller must survive for the next restore.
                if self._async_transport is None:
                    await http.aclose()

        restored = _run_blocking(download)
        self._restored = CheckpointRef(run=plan.run, step=plan.step)
        return restored

    def lineage(self, run: str, step: int) -> Lineage:
        """Ancestors (across runs, parent first) and direct children."""
        return self._send(_api.lineage(run, step))

    def advice(
        self,
        run: str,
        mtbf_hours: float,
        cost_seconds: float | None = None,
        restart_seconds: float | None = None,
        window: int | None = None,
    ) -> Advice:
        """Checkpoint interval advice (Young, Daly) from the run's observed
        write and upload times; ``cost_seconds`` overrides the observed cost."""
        call = _api.advice(
            run,
            mtbf_hours,
            cost_seconds=cost_seconds,
            restart_seconds=restart_seconds,
            window=window,
        )
        return self._send(call)
