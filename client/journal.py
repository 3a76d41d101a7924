"""Local journal of registrations the service could not take yet.

With ``CheckpointClient(..., journal=PATH)`` (or the async client), a
``register`` that finds the service unreachable (connection refused, timeout,
transport error, 503) is written here instead of raising, and a background
replayer sends it again, in order, until the service answers. The trainer
never blocks or crashes because the agent restarted.

The file is append-only JSON lines, each written with flush + fsync::

    {"id": "<uuid>", "body": {...register request body...}}
    {"done": "<uuid>"}

An entry is pending until a ``done`` line names it. Once nothing is pending
the file is truncated (compaction). A torn last line (a crash mid-write) is
ignored. One journal file belongs to one client at a time.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx

from .errors import ServerError
from .models import Checkpoint

log = logging.getLogger("tierckpt.client.journal")

# State of the Checkpoint returned by a journaled ``register``: the service has
# not seen it yet; the background replayer will register it.
PENDING_STATE = "pending_registration"

# Replay backoff: 0.5 s doubling to 10 s while the service stays unreachable.
BACKOFF_START = 0.5
BACKOFF_MAX = 10.0

# ServerError codes (no answer at all) that send a registration to the journal.
_JOURNAL_CODES = frozenset({"unreachable", "timeout", "transport_error"})


class RegistrationJournal:
    """Pending register request bodies in an fsync'd JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}  # insertion order = replay order
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._load()
        with self._lock:
            if not self._pending:
                self._compact()

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    log.warning("ignoring a torn line in registration journal %s", self.path)
                    continue
                if not isinstance(record, dict):
                    continue
                if "done" in record:
                    self._pending.pop(str(record["done"]), None)
                elif "id" in record and isinstance(record.get("body"), dict):
                    self._pending[str(record["id"])] = record["body"]

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def _compact(self) -> None:
        # Called with the lock held and nothing pending.
        with open(self.path, "w", encoding="utf-8") as handle:
            handle.flush()
            os.fsync(handle.fileno())

    def append(self, body: dict[str, Any]) -> str:
        """Journal one register request body; returns its id. Durable on return."""
        entry_id = uuid.uuid4().hex
        with self._lock:
            self._write({"id": entry_id, "body": body})
            self._pending[entry_id] = body
        return entry_id

    def mark_done(self, entry_id: str) -> None:
        with self._lock:
            if entry_id not in self._pending:
                return
            del self._pending[entry_id]
            if self._pending:
                self._write({"done": entry_id})
            else:
                self._compact()

    def entries(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, body) of every pending entry, oldest first."""
        with self._lock:
            return list(self._pending.items())

    def pending(self) -> list[dict[str, Any]]:
        """Bodies not done yet, oldest first."""
        return [body for _, body in self.entries()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def should_journal(exc: ServerError) -> bool:
    """True for "no answer" and 503: the service is (re)starting. Never 4xx."""
    return exc.code in _JOURNAL_CODES or exc.status == 503


def pending_checkpoint(body: dict[str, Any]) -> Checkpoint:
    """What a journaled ``register`` returns: ``state="pending_registration"``."""
    fields = ("run", "step", "world_size", "priority", "epoch", "metrics", "metadata", "parent")
    data = {key: body[key] for key in fields if key in body}
    data["state"] = PENDING_STATE
    data["write_seconds"] = body.get("write_seconds")
    return Checkpoint.model_validate(data)


def replay_outcome(response: httpx.Response | None) -> str:
    """``done`` (accepted), ``drop`` (refused for good) or ``retry``."""
    if response is None:
        return "retry"
    if response.status_code in (200, 201, 202):
        return "done"
    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
        return "drop"
    return "retry"


def next_backoff(delay: float) -> float:
    return min(BACKOFF_MAX, delay * 2)


def describe(body: dict[str, Any]) -> str:
    return f"{body.get('run')}:{body.get('step')} (rank {body.get('rank', 0)})"
