"""The I/O requests a client flow makes, and the two loops that carry them out.

A flow (see :mod:`._core`) is a generator: it yields one of the requests
below, the driver performs it and sends the answer back in (or throws the
exception it raised), until the flow returns its result. The flow itself
never touches a socket, a clock or a lock primitive, so the same flow serves
:class:`CheckpointClient` (threads, ``time.sleep``) and
:class:`AsyncCheckpointClient` (one event loop); each client only says how
it performs each request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from ._api import Call
from .models import Checkpoint, RestorePlan

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Http:
    """Send ``call`` once; answers the ``httpx.Response`` (or raises httpx's error)."""

    call: Call[Any]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``. In the journal replayer a closing client cuts it short."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Download:
    """Download and verify ``plan`` into ``dest``; answers the restored path."""

    plan: RestorePlan
    dest: str | os.PathLike[str]
    rank: int | None
    progress: Callable[[int, int], None] | None  # restore.Progress


@dataclass(frozen=True, slots=True)
class CopyLocal:
    """Copy ``checkpoint``'s files from this node's intact T0 copies
    (``checkpoint.local``) into ``dest``, each SHA-256 verified; answers the
    restored path, or None when a copy is gone or does not hash right (the
    flow then downloads)."""

    checkpoint: Checkpoint
    dest: str | os.PathLike[str]
    rank: int | None
    progress: Callable[[int, int], None] | None  # restore.Progress


@dataclass(frozen=True, slots=True)
class ReplayTurn:
    """Asked by the journal replayer before each round: answers False once
    the client is closing (the replayer then stops)."""


@dataclass(frozen=True, slots=True)
class ReplayIdle:
    """The journal is empty: wait until a registration is journaled."""


@dataclass(frozen=True, slots=True)
class JournalAppended:
    """A registration was journaled: wake the replayer."""


@dataclass(frozen=True, slots=True)
class JournalSettled:
    """The replayer settled an entry (replayed or dropped): wake whoever
    waits in ``flush_journal``."""


@dataclass(frozen=True, slots=True)
class JournalChange:
    """Wait, at most ``timeout`` seconds, until the journal may have emptied
    (an entry settled)."""

    timeout: float


Effect = (
    Http
    | Sleep
    | Download
    | CopyLocal
    | ReplayTurn
    | ReplayIdle
    | JournalAppended
    | JournalSettled
    | JournalChange
)
Flow = Generator[Effect, Any, T]


class _Stepper(Generic[T]):
    """Resumes a flow with the previous request's outcome; the part both
    drivers share."""

    def __init__(self, flow: Flow[T]) -> None:
        self.flow = flow
        self.answer: Any = None
        self.error: Exception | None = None
        self.result: T | None = None

    def next_request(self) -> Effect | None:
        """The flow's next request, or None once it returned (``result``)."""
        error, self.error = self.error, None
        try:
            if error is not None:
                return self.flow.throw(error)
            return self.flow.send(self.answer)
        except StopIteration as done:
            self.result = cast(T, done.value)
            return None


def drive(flow: Flow[T], perform: Callable[[Effect], Any]) -> T:
    """Run ``flow`` to its end in this thread, each request done by ``perform``."""
    step = _Stepper(flow)
    with contextlib.closing(flow):
        while (request := step.next_request()) is not None:
            try:
                step.answer = perform(request)
            except Exception as exc:  # the flow decides what a failure means
                step.error = exc
    return cast(T, step.result)


async def drive_async(flow: Flow[T], perform: Callable[[Effect], Awaitable[Any]]) -> T:
    """Run ``flow`` to its end on this event loop, each request awaited from ``perform``."""
    step = _Stepper(flow)
    with contextlib.closing(flow):
        while (request := step.next_request()) is not None:
            try:
                step.answer = await perform(request)
            except Exception as exc:
                step.error = exc
    return cast(T, step.result)
