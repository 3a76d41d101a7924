"""What a log line is about: the HTTP request, or the background job.

Both live in context variables. The request middleware sets the request id
for the duration of one request; the worker binds the job at the start of the
task that runs it (each job is its own asyncio task, so the binding never
leaks into another job), and everything the job awaits, spawns or sends to a
thread inherits it.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

    from ..models import Job

REQUEST_ID: ContextVar[str | None] = ContextVar("tierckpt_request_id", default=None)
# Facts a request's handler learns on the way (where a registration's time
# went), logged with the request's line by the middleware.
REQUEST_FACTS: ContextVar[dict[str, Any] | None] = ContextVar(
    "tierckpt_request_facts", default=None
)


def note_request(**facts: Any) -> None:
    """Add ``facts`` to the current request's log line (nothing outside a request)."""
    found = REQUEST_FACTS.get()
    if found is not None:
        found.update(facts)


@dataclass
class JobContext:
    job_id: int
    kind: str
    region: str | None
    checkpoint_id: int
    attempt: int
    run: str | None = None
    step: int | None = None
    started: float = field(default_factory=time.monotonic)
    # Facts a handler learns on the way (e.g. repair=True), logged with it.
    notes: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "job_kind": self.kind,
            "attempt": self.attempt,
            "checkpoint_id": self.checkpoint_id,
        }
        if self.run is not None:
            out["run"] = self.run
            out["step"] = self.step
        if self.region is not None:
            out["region"] = self.region
        out.update(self.notes)
        return out


JOB: ContextVar[JobContext | None] = ContextVar("tierckpt_job", default=None)

# Per catalog (its sessionmaker), checkpoint id -> (run, step): both never
# change, so a small LRU spares the catalog a lookup for the commit, replicate
# and verify jobs of the same checkpoint.
_NAMES: weakref.WeakKeyDictionary[Any, OrderedDict[int, tuple[str, int]]] = (
    weakref.WeakKeyDictionary()
)
_NAMES_MAX = 4096


async def _run_and_step(
    checkpoint_id: int, sessionmaker: async_sessionmaker[AsyncSession]
) -> tuple[str, int] | None:
    names = _NAMES.setdefault(sessionmaker, OrderedDict())
    if checkpoint_id in names:
        names.move_to_end(checkpoint_id)
        return names[checkpoint_id]
    from ..models import Checkpoint, Run

    async with sessionmaker() as session:
        row = (
            await session.execute(
                select(Run.name, Checkpoint.step)
                .join(Run, Run.id == Checkpoint.run_id)
                .where(Checkpoint.id == checkpoint_id)
            )
        ).first()
    if row is None:
        return None
    names[checkpoint_id] = (row[0], row[1])
    if len(names) > _NAMES_MAX:
        names.popitem(last=False)
    return row[0], row[1]


async def bind_job(job: Job, sessionmaker: async_sessionmaker[AsyncSession]) -> JobContext:
    """Make ``job`` the context of every log line and metric of this task."""
    context = JobContext(
        job_id=job.id,
        kind=job.kind,
        region=job.region,
        checkpoint_id=job.checkpoint_id,
        attempt=job.attempts,
    )
    JOB.set(context)
    try:
        names = await _run_and_step(job.checkpoint_id, sessionmaker)
    except Exception:  # the catalog is down: log without run/step, the job decides
        names = None
    if names is not None:
        context.run, context.step = names
    return context


def current_job() -> JobContext | None:
    return JOB.get()


def note(**facts: Any) -> None:
    """Attach facts to the current job (shown in its log lines)."""
    context = JOB.get()
    if context is not None:
        context.notes.update(facts)


def job_elapsed() -> float:
    """Seconds since the current job started (0 outside a job)."""
    context = JOB.get()
    return 0.0 if context is None else time.monotonic() - context.started
