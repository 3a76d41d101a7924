"""Asynchronous client of the tierckpt HTTP API (httpx.AsyncClient)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx

from . import _api
from ._api import DEFAULT_URL, USER_AGENT, Call, FilesLike, ParentLike
from ._download import TransferOptions
from .errors import NotFoundError, error_from_transport
from .models import Advice, Checkpoint, CheckpointRef, Lineage, RestorePlan, RunSummary
from .restore import Progress, check_destination, restore_from_plan

T = TypeVar("T")


class AsyncCheckpointClient:
    """``async with AsyncCheckpointClient(url, token) as c: await c.latest(run)``.

    ``transport`` replaces the network (tests, custom TLS); ``transfer`` tunes
    restore downloads.
    """

    _restored: CheckpointRef | None = None

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        retries: int = _api.RETRY_ATTEMPTS,
        transport: httpx.AsyncBaseTransport | None = None,
        transfer: TransferOptions | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        # 429/503/connection refused are retried with backoff this many times.
        self.retries = retries
        self._token = token
        self._transfer = transfer or TransferOptions()
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers={"User-Agent": USER_AGENT},
        )

    async def __aenter__(self) -> AsyncCheckpointClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            try:
                response = await self._http.request(**_api.request_args(call, self._token))
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
            await asyncio.sleep(delay)

    async def register(
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
        forgotten); pass None for no parent."""
        if isinstance(parent, _api._AutoParent):
            parent, self._restored = self._restored, None
        return await self._send(
            _api.register(
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
        )

    async def get(self, run: str, step: int) -> Checkpoint:
        return await self._send(_api.get(run, step))

    async def list_checkpoints(
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
        return await self._send(call)

    async def runs(self, limit: int | None = None, offset: int | None = None) -> list[RunSummary]:
        return await self._send(_api.runs(limit=limit, offset=offset))

    async def latest(
        self, run: str, region: str | None = None, node: str | None = None
    ) -> Checkpoint | None:
        """The latest valid checkpoint of ``run`` with its locations, or None."""
        return await self._send(_api.latest(run, region=region, node=node))

    async def wait(
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
            checkpoint = await self.get(run, step)
            if _api.wait_reached(checkpoint, target):
                return checkpoint
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                raise _api.wait_timeout_error(run, step, state, checkpoint, timeout)
            await asyncio.sleep(delay)

    async def verify(
        self, run: str, step: int, timeout: float | None = None, poll_interval: float = 0.2
    ) -> Checkpoint:
        """Re-read and re-hash every region's copy; returns once the
        verification jobs have finished, with the per-region outcome."""
        await self._send(_api.verify(run, step))
        deadline = _api.wait_deadline(timeout)
        while True:
            checkpoint = await self.get(run, step)
            if not checkpoint.verifying:
                return checkpoint
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                raise TimeoutError(f"verification of {run}:{step} still running after {timeout} s")
            await asyncio.sleep(delay)

    async def restore_plan(
        self, run: str, step: int | None = None, region: str | None = None, rank: int | None = None
    ) -> RestorePlan:
        """Where each file of a checkpoint can be downloaded from; ``step``
        defaults to the latest valid checkpoint."""
        if step is None:
            latest = await self.latest(run, region=region)
            if latest is None:
                raise NotFoundError(
                    f"run {run} has no valid checkpoint", code="no_valid_checkpoint"
                )
            step = latest.step
        return await self._send(_api.restore_plan(run, step, region=region, rank=rank))

    async def restore(
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
        plan = await self.restore_plan(run, step, region=region, rank=rank)
        restored = await restore_from_plan(
            plan,
            dest,
            http=self._http,
            token=self._token,
            rank=rank,
            progress=progress,
            options=self._transfer,
        )
        self._restored = CheckpointRef(run=plan.run, step=plan.step)
        return restored

    async def lineage(self, run: str, step: int) -> Lineage:
        """Ancestors (across runs, parent first) and direct children."""
        return await self._send(_api.lineage(run, step))

    async def advice(
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
        return await self._send(call)
