"""Registrations recorded on the node, written to the catalog behind the answer.

With ``[catalog] register_ack = "recorded"`` (the default on SQLite), a
registration of a new checkpoint is answered once recorded in this agent's inbox,
a directory on the node's SSD (``<first T0 root>/.tierckpt-inbox/``); the
registration writer (batching.py) takes it to the catalog right after. So
the trainer waits for the scan of its directory, one read of the catalog
and a small file written, never for the catalog's write lock, its
statements or a batch being committed, whatever the worker holds meanwhile.

Invariants:

* **Refusals stay synchronous.** Before anything is recorded, the catalog's
  row of the checkpoint is read (one snapshot, no lock) and the same rules as
  the writer's (batch_write.decide) are applied to it together with the
  registrations of the same step still in the inbox: a different content,
  world size, or a failed or deleted checkpoint is a 409 at once.
* **Only new checkpoints go through the inbox.** A registration of a
  checkpoint the catalog holds already (another rank, a repeat, an urgent
  promotion) is written and answered at its commit as before: its answer is
  read back from the catalog.
* **Nothing answered is lost to a kill -9.** The record is appended to the
  inbox's journal before the answer (inbox_journal.py); it is marked done
  only once the catalog has committed the registration. A restarted agent
  writes every record not marked done again (the same listing: a repeat of
  a committed one is answered as already registered). Like a registration
  answered at its commit, a power loss before the catalog's next log flush
  (milliseconds) can lose it, not its files; ``"committed"`` /
  ``"on_disk"`` wait for the catalog instead.
* **Read your own registration.** Until its record is written to the
  catalog, this agent answers the checkpoint's detail from the record, and
  its other per-run reads wait for the run's records first (``settled``).
* **A catalog outage delays, it does not refuse.** A record whose write
  fails for an outage is retried with backoff; while the catalog is down,
  the read before recording fails and the register answers 503 as before.

A record refused by the catalog after its answer (another agent registered
the same rank with other content in the moment between the read and the
write: one shared PostgreSQL catalog) is logged as an error and dropped.

Why not on PostgreSQL by default (``auto``): there the writer's answer is
one round trip (fresh_batch.py) and the read before a record is one too, so
the inbox saves little (a paced register's p99 11.4 against 13.9 ms on one
machine), and its write behind the answer shares the node with the
trainer's next request. A catalog several agents share is also where the
moment between the read and the write can let another agent's conflicting
registration in, so the answer given here would be dropped, not refused
(benchmarks/README.md, "Register latency: answered from the node's inbox"
and "Issue 16 on a twenty-eighth machine").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, bindparam, literal, select, union_all

from ..errors import ApiError, is_catalog_outage
from ..names import agent_directory_name
from ..observability import metrics
from ..resources import Resources
from .batch_plan import Planned, Registration
from .batch_write import answer_of_new, decide
from .batching import RegistrationBatcher
from .inbox_journal import InboxJournal, Ref
from .latest_answer import read_whole
from .scan import ScannedFile, ScannedShard
from .schemas import CheckpointOut, RegisterRequest
from .tables import CHECKPOINTS, RUNS

log = logging.getLogger("tierckpt.register")

INBOX_DIR = ".tierckpt-inbox"
RETRY_BASE, RETRY_MAX = 0.2, 10.0
# A record of at most this many files is encoded on the event loop (tens of
# microseconds), a larger one in a thread (the scan's own rule).
INLINE_RECORD_FILES = 64
# Writes of one record that fail other than for an outage before it is
# given up (logged, counted): an outage is waited out however long it lasts.
MAX_ERRORS = 8

# One statement (one round trip on PostgreSQL): the step's own row, if any,
# and the checkpoints naming it their parent (the new one's answer lists them).
_FOUND = union_all(
    select(literal("self").label("kind"), RUNS.c.name, CHECKPOINTS.c.step)
    .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
    .where(RUNS.c.name == bindparam("run"), CHECKPOINTS.c.step == bindparam("step")),
    select(literal("child").label("kind"), RUNS.c.name, CHECKPOINTS.c.step)
    .join(RUNS, RUNS.c.id == CHECKPOINTS.c.run_id)
    .where(
        CHECKPOINTS.c.parent_run == bindparam("run"),
        CHECKPOINTS.c.parent_step == bindparam("step"),
    ),
)


@dataclass(frozen=True)
class Found:
    """What the catalog holds of one (run, step), read in one snapshot."""

    exists: bool
    children: list[tuple[str, int]]  # checkpoints naming it their parent


def _found(connection: Connection, run: str, step: int) -> Found:
    exists, children = False, []
    for kind, name, child_step in connection.execute(_FOUND, {"run": run, "step": step}):
        if kind == "self":
            exists = True
        else:
            children.append((name, child_step))
    return Found(exists, children)


def to_record(registration: Registration) -> dict[str, Any]:
    scanned = registration.scanned
    assert registration.accepted_at is not None
    return {
        "request": registration.request.model_dump(mode="json", exclude_none=True),
        "directory": str(scanned.directory),
        "is_directory": scanned.is_directory,
        "files": [[f.path, f.size, f.mtime_ns] for f in scanned.files],
        "hashes": registration.hashes,
        "fingerprint": registration.fingerprint,
        "accepted_at": registration.accepted_at.replace(tzinfo=UTC).timestamp(),
    }


def from_record(record: dict[str, Any]) -> Registration:
    scanned = ScannedShard(
        directory=Path(record["directory"]),
        files=[ScannedFile(path, size, mtime_ns) for path, size, mtime_ns in record["files"]],
        is_directory=record["is_directory"],
    )
    registration = Registration(
        request=RegisterRequest.model_validate(record["request"]),
        scanned=scanned,
        hashes=record["hashes"],
        fingerprint=record["fingerprint"],
        accepted_at=_naive_utc(record["accepted_at"]),
    )
    return registration


@dataclass
class Entry:
    """One registration recorded and not yet in the catalog."""

    seq: int
    registration: Registration
    ref: Ref | None  # where it is recorded; None until appended
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> tuple[str, int]:
        return (self.registration.request.run, self.registration.request.step)


def inbox_directory(resources: Resources) -> Path:
    """On the node's SSD, beside the checkpoints it records; one per node and
    catalog, like the memory arena (two agents never share one)."""
    settings = resources.settings
    return (
        settings.local.roots[0]
        / INBOX_DIR
        / agent_directory_name(settings.server.node, settings.catalog.url)
    )


class RegistrationInbox:
    """The agent's inbox (built with the agent: agent.py)."""

    def __init__(
        self, resources: Resources, registrations: RegistrationBatcher, directory: Path
    ) -> None:
        self.r = resources
        self.registrations = registrations
        self.directory = directory
        self.journal = InboxJournal(directory)
        self._entries: dict[int, Entry] = {}
        self._by_key: dict[tuple[str, int], list[Entry]] = defaultdict(list)
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = 0
        self.refused = 0  # records the catalog refused after their answer

    def __len__(self) -> int:
        return len(self._entries)

    # -- the request's side --------------------------------------------------------------

    async def offer(self, registration: Registration) -> CheckpointOut | None:
        """Record ``registration`` and return its answer if it creates a
        checkpoint; None if the catalog holds the checkpoint already (the
        caller writes it through the writer and reads the answer back).
        Raises the writer's Conflict when the catalog would refuse it."""
        request = registration.request
        found = await read_whole(self.r, _found, request.run, request.step)
        if found.exists:
            return None
        registration = dataclasses.replace(registration, accepted_at=_naive_utc(time.time()))
        plan = self._plan_of(request.run, request.step, registration)
        decide(plan, len(plan.added), registration)  # raises the Conflict the writer would
        if not plan.added or plan.added[-1][1] is not registration:
            # The same content is recorded already: answered as a repeat is,
            # once that record is in the catalog.
            await self.settled(request.run, request.step)
            return None
        if not await self._record(registration):
            return None
        return answer_of_new(self.r, plan, found.children)

    async def _record(self, registration: Registration) -> bool:
        """Append the record to the journal (a kill -9 keeps it whole or
        not at all: inbox_journal.py) and start its way to the catalog;
        False if the SSD refused it (full, gone): the caller then goes the
        writer's way."""
        self._seq += 1
        entry = Entry(self._seq, registration, None)
        # Indexed first: a rank of the same step arriving while a large
        # record is encoded in a thread is decided against this one.
        self._index(entry)
        record = to_record(registration)
        try:
            if len(registration.scanned.files) <= INLINE_RECORD_FILES:
                text = json.dumps(record)  # cheaper than the thread hand-off
            else:
                text = await asyncio.to_thread(json.dumps, record)
            # On the loop: the journal's appends never interleave.
            entry.ref = self.journal.append(text)
        except OSError as exc:
            self._forget(entry)
            log.warning("inbox: cannot record a registration (%s); written at once", exc)
            return False
        self._start(entry)
        return True

    def _index(self, entry: Entry) -> None:
        self._entries[entry.seq] = entry
        self._by_key[entry.key].append(entry)

    def _start(self, entry: Entry) -> None:
        task = asyncio.create_task(self._ingest(entry), name="register-inbox")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self, run: str | None, step: int | None = None, timeout: float = 5.0) -> bool:
        """Wait until the records of ``run`` (at ``step``; every run's when
        ``run`` is None) are in the catalog (or refused); False if some still
        are not after ``timeout``. Only the records pending at the call are
        waited for: a stream of new ones cannot hold the caller."""
        # Records live milliseconds: the pending ones are few, when any.
        if run is not None and step is not None:
            entries = list(self._by_key.get((run, step), []))
        else:
            entries = [
                e for key, same in self._by_key.items() if run in (None, key[0]) for e in same
            ]
        if not entries:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                for entry in entries:
                    await entry.done.wait()
                return True
        return False

    def answer_of(self, run: str, step: int) -> CheckpointOut | None:
        """The detail of a checkpoint whose records are not in the catalog
        yet (the catalog is slow or down): as its registration answered."""
        if not self._by_key.get((run, step)):
            return None
        plan = self._plan_of(run, step)
        return answer_of_new(self.r, plan, [])

    def _plan_of(self, run: str, step: int, first: Registration | None = None) -> Planned:
        """The checkpoint as the writer will create it from the step's records
        (their first one creating it; ``first`` when there is none yet)."""
        pending = self._by_key.get((run, step), [])
        creator = pending[0].registration if pending else first
        assert creator is not None and creator.accepted_at is not None
        # The run's id is not needed: the answer names the run.
        plan = Planned.creating((0, step), run, creator.request, creator.accepted_at)
        for index, entry in enumerate(pending):
            decide(plan, index, entry.registration)  # recorded: they pass
        return plan

    # -- the agent's side ----------------------------------------------------------------

    def recover(self) -> int:
        """Take up the records an earlier life of the agent left (in their
        order); their writes start at once. Returns how many."""
        found = 0
        for ref, text in self.journal.recover():
            try:
                registration = from_record(json.loads(text))
            except (ValueError, KeyError, TypeError) as exc:
                # Kept for an operator across restarts, never retried.
                self.journal.set_aside(ref, text, str(exc))
                continue
            self._seq += 1
            entry = Entry(self._seq, registration, ref)
            self._index(entry)
            self._start(entry)
            found += 1
        if found:
            log.info("inbox: %d registration(s) recorded before a restart go to the catalog", found)
        return found

    async def _ingest(self, entry: Entry) -> None:
        delay = RETRY_BASE
        errors = 0  # failures other than an outage: a lock or statement timeout, a bug
        try:
            while True:
                try:
                    await self.registrations.submit(entry.registration)
                    break
                except ApiError as exc:
                    if exc.status < 500:  # the catalog's decision (409): final
                        self._refused(entry, exc.message)
                        break
                    reason = exc.message
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    if not is_catalog_outage(exc):
                        errors += 1
                        if errors >= MAX_ERRORS:
                            self._refused(entry, reason)
                            break
                log.warning(
                    "inbox: %s step %s waits for the catalog (%s); retrying in %.1f s",
                    *entry.key,
                    reason,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
            assert entry.ref is not None
            self.journal.done(entry.ref)
        finally:
            self._forget(entry)

    def _refused(self, entry: Entry, reason: str) -> None:
        self.refused += 1
        metrics.count_registration_refused_late()
        log.error(
            "inbox: the catalog refused %s step %s rank %s after it was answered: %s",
            *entry.key,
            entry.registration.request.rank,
            reason,
        )

    def _forget(self, entry: Entry) -> None:
        if self._entries.pop(entry.seq, None) is None:
            return
        same = self._by_key.get(entry.key, [])
        if entry in same:
            same.remove(entry)
        if not same:
            self._by_key.pop(entry.key, None)
        entry.done.set()

    async def close(self, timeout: float) -> None:
        """Let the records being written reach the catalog for up to
        ``timeout`` seconds; those left stay on disk for the next start."""
        tasks = list(self._tasks)
        left: set[asyncio.Task[None]] = set()
        if tasks:
            _done, left = await asyncio.wait(tasks, timeout=timeout)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        if left:
            log.warning("inbox: %d registration(s) left for the next start", len(left))
        self.journal.close()


def _naive_utc(timestamp: float) -> datetime:
    """The catalog's time convention (models.utcnow): UTC without a zone."""
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)
