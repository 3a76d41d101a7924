"""The registration inbox's records (service/checkpoints/inbox.py): what a
restarted agent takes up, in which order, and what becomes of each write,
against an in-memory writer standing in for the agent's group commit."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from tierckpt.service.checkpoints import inbox as inbox_module
from tierckpt.service.checkpoints.batch_plan import Outcome, Registration
from tierckpt.service.checkpoints.batching import RegistrationBatcher
from tierckpt.service.checkpoints.inbox import RegistrationInbox, from_record, to_record
from tierckpt.service.checkpoints.scan import ScannedFile, ScannedShard
from tierckpt.service.checkpoints.schemas import RegisterRequest
from tierckpt.service.errors import Conflict
from tierckpt.service.resources import Resources


class Writer:
    """The writer's interface (``submit``), answering from a script."""

    def __init__(self, *script: BaseException | None) -> None:
        self.script = list(script)
        self.written: list[tuple[str, int]] = []

    async def submit(self, registration: Registration) -> Outcome:
        if self.script:
            failure = self.script.pop(0)
            if failure is not None:
                raise failure
        self.written.append((registration.request.run, registration.request.step))
        return Outcome(created=True, record=None)


def _registration(step: int) -> Registration:
    request = RegisterRequest(
        run="r", step=step, path=f"/ssd/r/step-{step}", metrics={"loss": 1.5}, priority="urgent"
    )
    scanned = ScannedShard(
        directory=Path(f"/ssd/r/step-{step}"),
        files=[ScannedFile("model.safetensors", 10, 123), ScannedFile("sub/a.json", 2, 456)],
    )
    accepted_at = datetime.fromtimestamp(float(step), UTC).replace(tzinfo=None)
    return Registration(request, scanned, {"sub/a.json": "ab" * 32}, f"print-{step}", accepted_at)


def _inbox(directory: Path, writer: Writer) -> RegistrationInbox:
    # recover() and the writes use neither the catalog nor the settings.
    return RegistrationInbox(cast(Resources, None), cast(RegistrationBatcher, writer), directory)


def _write(directory: Path, name: str, record: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(record))


def test_a_record_reads_back_as_the_registration_it_was() -> None:
    registration = _registration(3)
    back = from_record(json.loads(json.dumps(to_record(registration))))
    assert back.request == registration.request
    assert back.scanned == registration.scanned
    assert (back.hashes, back.fingerprint) == (registration.hashes, registration.fingerprint)
    # The checkpoint's created_at: when it was accepted (naive UTC, as the catalog's).
    assert back.accepted_at == datetime.fromtimestamp(3.0, UTC).replace(tzinfo=None)


async def test_a_restarted_agent_writes_the_records_it_finds_in_order(tmp_path: Path) -> None:
    directory = tmp_path / "inbox"
    _write(directory, "00000000000000000002-00000001.json", to_record(_registration(2)))
    _write(directory, "00000000000000000001-00000007.json", to_record(_registration(1)))
    _write(directory, "00000000000000000003-00000001.json", {"request": "cut"})
    (directory / ".00000000000000000004-00000001.json.abc").write_text("{")  # before its rename
    writer = Writer()
    inbox = _inbox(directory, writer)
    assert inbox.recover() == 2
    assert len(inbox) == 2
    assert await inbox.settled("r", timeout=5)
    assert writer.written == [("r", 1), ("r", 2)]
    left = sorted(p.name for p in directory.iterdir())
    # Written records are removed; the unreadable one is kept aside, not retried.
    assert left == ["unreadable-00000000000000000003-00000001.json"]
    # ... and still kept (not retried, not removed) by the next start.
    assert _inbox(directory, Writer()).recover() == 0
    assert sorted(p.name for p in directory.iterdir()) == left


async def test_an_outage_is_waited_out_and_a_refusal_is_final(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inbox_module, "RETRY_BASE", 0.01)
    directory = tmp_path / "inbox"
    _write(directory, "00000000000000000001-00000001.json", to_record(_registration(1)))
    _write(directory, "00000000000000000002-00000001.json", to_record(_registration(2)))
    # Step 1: two outages, then written. Step 2: the catalog refuses it.
    writer = Writer(ConnectionError("refused"), ConnectionError("refused"), None, Conflict("no"))
    inbox = _inbox(directory, writer)
    inbox.recover()
    assert await inbox.settled("r", timeout=5)
    assert writer.written == [("r", 1)]
    assert inbox.refused == 1
    assert list(directory.iterdir()) == []


async def test_records_left_at_close_stay_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inbox_module, "RETRY_BASE", 0.01)
    directory = tmp_path / "inbox"
    _write(directory, "00000000000000000001-00000001.json", to_record(_registration(1)))
    writer = Writer(*[ConnectionError("down")] * 1000)
    inbox = _inbox(directory, writer)
    inbox.recover()
    await asyncio.sleep(0.05)
    assert not await inbox.settled("r", 1, timeout=0.05)
    await inbox.close(timeout=0.1)
    assert [p.name for p in directory.iterdir()] == ["00000000000000000001-00000001.json"]
    again = Writer()
    restarted = _inbox(directory, again)
    assert restarted.recover() == 1
    assert await restarted.settled("r", timeout=5)
    assert again.written == [("r", 1)] and list(directory.iterdir()) == []
