"""What the sync and async clients share: their state and every multi-step flow.

Each public call is written once here as a flow (a generator, see
:mod:`._effects`) under the public name with a leading underscore;
:class:`CheckpointClient` and :class:`AsyncCheckpointClient` turn each into
their public method with :func:`public_method` and perform its I/O requests
their own way. The flows are the client's behaviour: retries with backoff
(``_send``), registration with the journal, waiting and verifying by
polling, restore plans, and the journal's replay and flush.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from . import _api, _effects
from . import journal as _journal
from ._api import USER_AGENT, Call, FilesLike, ParentLike
from ._download import TransferOptions
from ._download_transport import download_transport
from ._effects import Flow
from .errors import NotFoundError, ServerError, error_from_transport
from .models import (
    Advice,
    Checkpoint,
    CheckpointRef,
    Lineage,
    MemoryInfo,
    MemorySegment,
    Prefetch,
    PrefetchJob,
    RestorePlan,
    RunSummary,
)
from .restore import Progress, check_destination, restore_from_plan

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("tierckpt.client.journal")

# How long a flush waits on the journal at most before looking again.
_FLUSH_RECHECK = 0.5


def public_method(flow_method: Callable[..., Any], method: F, owner: str) -> F:
    """Dress ``method``, class ``owner``'s runner of ``flow_method``, as the
    public call: its name without the underscore, its docstring, and its
    signature answering what the flow returns (``Flow[Checkpoint]`` ->
    ``Checkpoint``)."""
    signature = inspect.signature(flow_method)
    returns = signature.return_annotation
    if isinstance(returns, str) and returns.startswith("Flow["):
        returns = returns.removeprefix("Flow[").removesuffix("]")
    method.__name__ = flow_method.__name__.removeprefix("_")
    method.__qualname__ = f"{owner}.{method.__name__}"
    method.__doc__ = flow_method.__doc__
    method.__annotations__ = {**flow_method.__annotations__, "return": returns}
    method.__signature__ = signature.replace(return_annotation=returns)  # type: ignore[attr-defined]
    return method


class ClientCore:
    """Connection settings, the journal, and the flows of both clients."""

    _restored: CheckpointRef | None = None
    # Where restore downloads go (the caller's transport; None: the tuned
    # direct one). Set by the public clients (_face.py).
    _download_transport: httpx.AsyncBaseTransport | None = None

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout: float,
        retries: int,
        transfer: TransferOptions | None,
        journal: str | os.PathLike[str] | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # 429/503/connection refused are retried with backoff this many times.
        self.retries = retries
        self._token = token
        self._timeout = timeout
        self._transfer = transfer or TransferOptions()
        self._journal = None if journal is None else _journal.RegistrationJournal(journal)
        # Held while the replayer settles an entry and while a flush takes
        # the count, so the count always matches what left the journal.
        self._journal_lock = threading.Lock()
        self._replayed = 0

    def _http_options(self, transport: Any) -> dict[str, Any]:
        """What every httpx client of this client is built with."""
        return {
            "base_url": self.base_url,
            "timeout": self._timeout,
            "transport": transport,
            "headers": {"User-Agent": USER_AGENT},
        }

    # -- sending -------------------------------------------------------------------

    def _send(self, call: Call[T], retries: int | None = None) -> Flow[T]:
        """``call``'s answer, retried ``retries`` times (the client's own by
        default) after 429, 503 or no connection."""
        attempts = self.retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response = yield _effects.Http(call)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                delay = _api.retry_after(None, attempt, attempts)
                if delay is None:
                    raise error_from_transport(exc, self.base_url) from exc
            except httpx.RequestError as exc:
                raise error_from_transport(exc, self.base_url) from exc
            else:
                delay = _api.retry_after(response, attempt, attempts)
                if delay is None:
                    return _api.parse_response(call, response)
            attempt += 1
            yield _effects.Sleep(delay)

    # -- the public calls ------------------------------------------------------------

    def _register(
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
    ) -> Flow[Checkpoint]:
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
        try:
            return (yield from self._send(call))
        except ServerError as exc:
            if self._journal is None or not _journal.should_journal(exc):
                raise
            self._journal.append(call.body)
            yield _effects.JournalAppended()
            log.warning(
                "journaled registration of %s: %s", _journal.describe(call.body), exc.message
            )
            return _journal.pending_checkpoint(call.body)

    def _get(self, run: str, step: int) -> Flow[Checkpoint]:
        return self._send(_api.get(run, step))

    def _list_checkpoints(
        self,
        run: str,
        state: str | None = None,
        min_step: int | None = None,
        max_step: int | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> Flow[list[Checkpoint]]:
        """Checkpoints of ``run``, newest step first, without their file lists."""
        call = _api.list_checkpoints(
            run, state=state, min_step=min_step, max_step=max_step, limit=limit, offset=offset
        )
        return self._send(call)

    def _runs(self, limit: int | None = None, offset: int | None = None) -> Flow[list[RunSummary]]:
        return self._send(_api.runs(limit=limit, offset=offset))

    def _latest(
        self,
        run: str,
        region: str | None = None,
        node: str | None = None,
        scope: str | None = None,
        peer_safe: bool = False,
    ) -> Flow[Checkpoint | None]:
        """The latest valid checkpoint of ``run`` with its locations, or None.

        ``scope="node"`` (with ``node``): the newest checkpoint that node
        holds in memory or on T0, durable or not (``durable_step`` says what
        the durable latest is, ``memory`` where the node's memory holds it).
        Not durable means lost with the node: see docs/API.md.
        ``peer_safe``: the newest peer-safe checkpoint when it is newer than
        the newest durable one (peers hold verified copies of every shard;
        lost only if every node holding it is lost: see docs/API.md)."""
        return self._send(
            _api.latest(run, region=region, node=node, scope=scope, peer_safe=peer_safe)
        )

    def _memory_info(self) -> Flow[MemoryInfo]:
        """The agent's memory tier: enabled, budget, bytes used, policy when full."""
        return self._send(_api.memory_info())

    def _reserve_segment(
        self,
        run: str,
        step: int,
        files: Mapping[str, int],
        rank: int = 0,
        world_size: int = 1,
    ) -> Flow[MemorySegment]:
        """Reserve room in the agent's memory tier for ``files`` (relative
        path -> exact size); write them into the segment's ``path``, then
        ``register_segment``. ServerError ``memory_full`` when it is full."""
        return self._send(_api.reserve_segment(run, step, files, rank=rank, world_size=world_size))

    def _register_segment(
        self,
        segment_id: str,
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
        write_seconds: float | None = None,
        reserve_next: bool = False,
    ) -> Flow[Checkpoint]:
        """Register a complete memory segment as the checkpoint that will be
        at ``path`` (T0): the agent writes it there, then registers it. The
        answer is the checkpoint in state ``staged``; with ``reserve_next``
        (an agent whose ``memory_info().reserve_next`` says it can), its
        ``next_segment`` is a segment of the same files reserved for the
        run's next save: write that save into it and register it, with no
        ``reserve_segment`` call (None when the arena had no room)."""
        if isinstance(parent, _api._AutoParent):
            parent, self._restored = self._restored, None
        registration = _api.register(
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
            write_seconds=write_seconds,
        )
        return self._send(
            _api.register_segment(segment_id, registration, reserve_next=reserve_next)
        )

    def _release_segment(self, segment_id: str, retry: bool = True) -> Flow[None]:
        """Give back a reserved segment that will not be registered. Without
        ``retry``, one attempt (a trainer that is done need not wait for an
        agent that is gone: the segment's lease reclaims it)."""
        return self._send(_api.release_segment(segment_id), None if retry else 0)

    def _wait(
        self,
        run: str,
        step: int,
        state: str = "durable",
        timeout: float | None = None,
        poll_interval: float = 0.2,
    ) -> Flow[Checkpoint]:
        """Poll until the checkpoint reaches at least ``state``.

        Raises CheckpointFailedError if it ends failed/corrupt/deleted and
        TimeoutError after ``timeout`` seconds.
        """
        return self._wait_for(run, step, state, timeout, poll_interval)

    def _wait_for(
        self,
        run: str,
        step: int,
        state: str,
        timeout: float | None,
        poll_interval: float = 0.2,
        on_poll: Callable[[Checkpoint], None] | None = None,
    ) -> Flow[Checkpoint]:
        """``wait``, showing every poll to ``on_poll`` (the CLI's progress)."""
        target = _api.check_wait_target(state)

        def reached(checkpoint: Checkpoint) -> bool:
            if on_poll is not None:
                on_poll(checkpoint)
            return _api.wait_reached(checkpoint, target)

        def too_late(last: Checkpoint) -> Exception:
            return _api.wait_timeout_error(run, step, state, last, timeout)

        return self._poll(run, step, reached, too_late, timeout, poll_interval)

    def _verify(
        self, run: str, step: int, timeout: float | None = None, poll_interval: float = 0.2
    ) -> Flow[Checkpoint]:
        """Re-read and re-hash every region's copy; returns once the
        verification jobs have finished, with the per-region outcome."""
        yield from self._send(_api.verify(run, step))

        def too_late(last: Checkpoint) -> Exception:
            return TimeoutError(f"verification of {run}:{step} still running after {timeout} s")

        return (
            yield from self._poll(
                run, step, lambda c: not c.verifying, too_late, timeout, poll_interval
            )
        )

    def _poll(
        self,
        run: str,
        step: int,
        done: Callable[[Checkpoint], bool],
        too_late: Callable[[Checkpoint], Exception],
        timeout: float | None,
        poll_interval: float,
    ) -> Flow[Checkpoint]:
        """Get the checkpoint every ``poll_interval`` until ``done`` says so;
        raises ``too_late(last seen)`` after ``timeout`` seconds."""
        deadline = _api.wait_deadline(timeout)
        while True:
            checkpoint = yield from self._get(run, step)
            if done(checkpoint):
                return checkpoint
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                raise too_late(checkpoint)
            yield _effects.Sleep(delay)

    def _restore_plan(
        self,
        run: str,
        step: int | None = None,
        region: str | None = None,
        rank: int | None = None,
        chunks: bool = False,
    ) -> Flow[RestorePlan]:
        """Where each file of a checkpoint can be downloaded from; ``step``
        defaults to the latest valid checkpoint. ``chunks``: with each file's
        chunk hashes (to verify byte ranges, see ``tierckpt.client.dcp``)."""
        if step is None:
            latest = yield from self._latest(run, region=region)
            if latest is None:
                raise NotFoundError(
                    f"run {run} has no valid checkpoint", code="no_valid_checkpoint"
                )
            step = latest.step
        call = _api.restore_plan(run, step, region=region, rank=rank, chunks=chunks)
        return (yield from self._send(call))

    def _restore(
        self,
        run: str,
        dest: str | os.PathLike[str],
        step: int | None = None,
        region: str | None = None,
        rank: int | None = None,
        progress: Progress | None = None,
        node: str | None = None,
    ) -> Flow[Path]:
        """Download and verify a checkpoint into ``dest`` (which must not exist
        or be empty); returns ``dest``. Falls back across regions.

        ``node`` (this node's name as its agent knows it): when the agent
        vouches for intact T0 copies of the checkpoint on it (the node's own,
        or a prefetched one; the latest valid checkpoint only), the files are
        copied from there, each SHA-256 verified, and no region is read."""
        check_destination(dest)
        if node is not None:
            latest = yield from self._latest(run, region=region, node=node)
            if latest is not None and latest.local is not None and step in (None, latest.step):
                copied = yield _effects.CopyLocal(latest, dest, rank, progress)
                if copied is not None:
                    self._restored = CheckpointRef(run=latest.run, step=latest.step)
                    return Path(copied)
        plan = yield from self._restore_plan(run, step, region=region, rank=rank)
        restored: Path = yield _effects.Download(plan, dest, rank, progress)
        self._restored = CheckpointRef(run=plan.run, step=plan.step)
        return restored

    def _prefetch(
        self,
        run: str,
        nodes: Sequence[str],
        step: int | None = None,
        wait: bool = False,
        timeout: float | None = None,
        poll_interval: float = 0.5,
    ) -> Flow[Prefetch]:
        """Ask the agents of ``nodes`` to bring ``step`` (default: the latest
        valid checkpoint) into their T0, verified, before a restart there;
        ``latest(run, node=...)`` then offers that copy. With ``wait``, poll
        until every node's job has succeeded or failed (see ``failed``);
        TimeoutError after ``timeout`` seconds."""
        asked = yield from self._send(_api.prefetch(run, nodes, step=step))
        if not wait or asked.done:
            return asked
        ids = {job.id for job in asked.jobs}
        deadline = _api.wait_deadline(timeout)
        while True:
            delay = _api.next_poll_delay(deadline, poll_interval)
            if delay is None:
                pending = ", ".join(j.node for j in asked.jobs if not j.done)
                raise TimeoutError(
                    f"prefetch of {run}:{asked.step} still running after {timeout} s on {pending}"
                )
            yield _effects.Sleep(delay)
            jobs = yield from self._send(
                _api.prefetch_jobs(run, step=asked.step, limit=min(4096, max(100, 2 * len(ids))))
            )
            by_id = {job.id: job for job in jobs if job.id in ids}
            asked = asked.model_copy(
                update={"jobs": [by_id.get(job.id, job) for job in asked.jobs]}
            )
            if asked.done:
                return asked

    def _prefetch_jobs(
        self, run: str, step: int | None = None, limit: int | None = None
    ) -> Flow[list[PrefetchJob]]:
        """The run's prefetch jobs, newest first (of ``step`` only)."""
        return self._send(_api.prefetch_jobs(run, step=step, limit=limit))

    def _lineage(self, run: str, step: int) -> Flow[Lineage]:
        """Ancestors (across runs, parent first) and direct children."""
        return self._send(_api.lineage(run, step))

    def _advice(
        self,
        run: str,
        mtbf_hours: float,
        cost_seconds: float | None = None,
        restart_seconds: float | None = None,
        window: int | None = None,
    ) -> Flow[Advice]:
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

    # -- the journal -----------------------------------------------------------------

    def _flush_journal(self, timeout: float | None = None) -> Flow[int]:
        """Wait until every journaled registration reached the service;
        returns how many were replayed (accepted) since the last flush.
        Refused ones (4xx) are dropped with a warning and not counted.
        Raises TimeoutError after ``timeout`` seconds."""
        journal = self._journal
        if journal is None:
            return 0
        deadline = _api.wait_deadline(timeout)
        while len(journal):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"{len(journal)} journaled registrations still pending after {timeout} s"
                )
            yield _effects.JournalChange(
                _FLUSH_RECHECK if remaining is None else min(_FLUSH_RECHECK, remaining)
            )
        with self._journal_lock:
            replayed, self._replayed = self._replayed, 0
        return replayed

    def _replay(self) -> Flow[None]:
        """The background replayer: send journaled registrations, oldest
        first, backing off while the service stays unreachable, until the
        client closes."""
        journal = self._journal
        assert journal is not None
        delay = _journal.BACKOFF_START
        while (yield _effects.ReplayTurn()):
            entries = journal.entries()
            if not entries:
                yield _effects.ReplayIdle()
                continue
            entry_id, body = entries[0]
            response: httpx.Response | None
            try:
                response = yield _effects.Http(Call("POST", "/v1/checkpoints", dict, body=body))
            except Exception:  # the service is down, or this client is closing
                response = None
            outcome = _journal.replay_outcome(response)
            if outcome == "retry":
                yield _effects.Sleep(delay)
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
            with self._journal_lock:
                journal.mark_done(entry_id)
                if outcome == "done":
                    self._replayed += 1
            yield _effects.JournalSettled()

    # -- restore downloads -------------------------------------------------------------

    async def _download(self, request: _effects.Download) -> Path:
        """Perform a :class:`_effects.Download`, on the running loop, through
        the caller's download transport when it gave one, else through a
        client of its own over the tuned transport that reads presigned URLs
        directly."""
        given = self._download_transport
        own = given is None
        http = httpx.AsyncClient(
            **self._http_options(download_transport(self._transfer) if given is None else given)
        )
        try:
            return await restore_from_plan(
                request.plan,
                request.dest,
                http=http,
                token=self._token,
                rank=request.rank,
                progress=request.progress,
                options=self._transfer,
                direct=own,
            )
        finally:
            # Closing a client closes its transport; the caller's must survive.
            if own:
                await http.aclose()
