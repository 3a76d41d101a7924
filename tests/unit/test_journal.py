"""The client's registration journal: file format, replay order, 4xx drop,
compaction, and a restart with a non-empty journal (httpx.MockTransport that
is either "down", raising ConnectError, or "up")."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierckpt.client import AsyncCheckpointClient, CheckpointClient, ConflictError, ServerError
from tierckpt.client import journal as journal_module
from tierckpt.client.journal import PENDING_STATE, RegistrationJournal

BASE_URL = "http://api.test"


class FakeService:
    """POST /v1/checkpoints only; ``up`` False refuses connections."""

    def __init__(self) -> None:
        self.up = False
        self.status_when_down: int | None = None  # e.g. 503 instead of no answer
        self.refuse: dict[int, int] = {}  # step -> 4xx status
        self.received: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            if self.status_when_down is None:
                raise httpx.ConnectError("connection refused", request=request)
            error = {"error": {"code": "catalog_unavailable", "message": "catalog down"}}
            return httpx.Response(self.status_when_down, json=error)
        body = json.loads(request.content)
        if body["step"] in self.refuse:
            error = {"error": {"code": "conflict", "message": "files changed"}}
            return httpx.Response(self.refuse[body["step"]], json=error)
        self.received.append(body)
        answer = {"run": body["run"], "step": body["step"], "state": "registered"}
        return httpx.Response(202, json=answer)

    @property
    def steps(self) -> list[int]:
        return [body["step"] for body in self.received]


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "BACKOFF_START", 0.02)
    monkeypatch.setattr(journal_module, "BACKOFF_MAX", 0.1)


def client(service: FakeService, path: Path) -> CheckpointClient:
    return CheckpointClient(
        BASE_URL, retries=0, transport=httpx.MockTransport(service), journal=path
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_file_format_is_fsynced_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = journal_module.os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    path = tmp_path / "j" / "journal.jsonl"
    journal = RegistrationJournal(path)
    synced.clear()
    first = journal.append({"run": "r", "step": 1})
    second = journal.append({"run": "r", "step": 2})
    assert len(synced) == 2
    journal.mark_done(first)
    assert len(synced) == 3
    assert lines(path) == [
        {"id": first, "body": {"run": "r", "step": 1}},
        {"id": second, "body": {"run": "r", "step": 2}},
        {"done": first},
    ]
    assert journal.pending() == [{"run": "r", "step": 2}]
    # Reopened: the same pending entries, same order.
    assert RegistrationJournal(path).entries() == [(second, {"run": "r", "step": 2})]


def test_compaction_when_everything_is_done(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = RegistrationJournal(path)
    ids = [journal.append({"run": "r", "step": step}) for step in (1, 2, 3)]
    for entry_id in ids:
        journal.mark_done(entry_id)
    assert journal.pending() == []
    assert path.stat().st_size == 0


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = RegistrationJournal(path)
    journal.append({"run": "r", "step": 1})
    with open(path, "a") as handle:
        handle.write('{"id": "x", "bo')
    assert RegistrationJournal(path).pending() == [{"run": "r", "step": 1}]


def test_without_journal_an_unreachable_service_still_raises(tmp_path: Path) -> None:
    service = FakeService()
    with CheckpointClient(BASE_URL, retries=0, transport=httpx.MockTransport(service)) as c:
        with pytest.raises(ServerError) as caught:
            c.register("r", 1, tmp_path / "ckpt")
    assert caught.value.code == "unreachable"


def test_register_while_down_is_journaled_and_replayed_in_order(tmp_path: Path) -> None:
    service = FakeService()
    path = tmp_path / "journal.jsonl"
    with client(service, path) as c:
        results = [c.register("r", step, tmp_path / f"s{step}", parent=None) for step in (1, 2, 3)]
        assert [r.state for r in results] == [PENDING_STATE] * 3
        assert [r.step for r in results] == [1, 2, 3]
        assert [body["step"] for body in RegistrationJournal(path).pending()] == [1, 2, 3]
        assert lines(path)[0]["body"]["path"] == str(tmp_path / "s1")
        service.up = True
        assert c.flush_journal(timeout=10) == 3
        assert service.steps == [1, 2, 3]
        # Up: a register goes straight through.
        assert c.register("r", 4, tmp_path / "s4", parent=None).state == "registered"
        assert c.flush_journal(timeout=1) == 0
    assert path.stat().st_size == 0


def test_503_is_journaled_but_4xx_at_register_raises(tmp_path: Path) -> None:
    service = FakeService()
    service.status_when_down = 503
    path = tmp_path / "journal.jsonl"
    with client(service, path) as c:
        assert c.register("r", 1, tmp_path / "s1", parent=None).state == PENDING_STATE
        service.up = True
        assert c.flush_journal(timeout=10) == 1
        service.refuse[2] = 409
        with pytest.raises(ConflictError):
            c.register("r", 2, tmp_path / "s2", parent=None)
        assert RegistrationJournal(path).pending() == []
    assert service.steps == [1]


def test_4xx_on_replay_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = FakeService()
    path = tmp_path / "journal.jsonl"
    with client(service, path) as c:
        for step in (1, 2, 3):
            c.register("r", step, tmp_path / f"s{step}", parent=None)
        service.refuse[2] = 409  # the files changed while the service was down
        service.up = True
        with caplog.at_level(logging.WARNING, logger="tierckpt.client.journal"):
            assert c.flush_journal(timeout=10) == 2
    assert service.steps == [1, 3]
    assert any("dropping" in r.message and "r:2" in r.message for r in caplog.records)
    assert path.stat().st_size == 0


def test_close_keeps_entries_and_a_new_client_replays_them(tmp_path: Path) -> None:
    service = FakeService()
    path = tmp_path / "journal.jsonl"
    with client(service, path) as c:
        c.register("r", 1, tmp_path / "s1", parent=None)
        c.register("r", 2, tmp_path / "s2", parent=None)
        with pytest.raises(TimeoutError):
            c.flush_journal(timeout=0.2)
    assert [body["step"] for body in RegistrationJournal(path).pending()] == [1, 2]
    service.up = True
    with client(service, path) as again:
        deadline = time.monotonic() + 10
        while service.steps != [1, 2]:  # replayed at construction, before any call
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert again.flush_journal(timeout=10) == 2
    assert path.stat().st_size == 0


async def test_async_client_journals_and_replays(tmp_path: Path) -> None:
    service = FakeService()
    path = tmp_path / "journal.jsonl"
    transport = httpx.MockTransport(service)
    async with AsyncCheckpointClient(BASE_URL, retries=0, transport=transport, journal=path) as c:
        for step in (1, 2, 3):
            result = await c.register("r", step, tmp_path / f"s{step}", parent=None)
            assert result.state == PENDING_STATE
        service.refuse[2] = 409
        service.up = True
        assert await c.flush_journal(timeout=10) == 2
    assert service.steps == [1, 3]

    service.up = False
    async with AsyncCheckpointClient(BASE_URL, retries=0, transport=transport, journal=path) as c:
        await c.register("r", 4, tmp_path / "s4", parent=None)
    assert [body["step"] for body in RegistrationJournal(path).pending()] == [4]
    service.up = True
    async with AsyncCheckpointClient(BASE_URL, retries=0, transport=transport, journal=path) as c:
        assert await c.flush_journal(timeout=10) == 1
    assert service.steps == [1, 3, 4]
