"""The registration inbox's journal (service/checkpoints/inbox_journal.py):
what a start takes up again after a life that ended any way, on real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierckpt.service.checkpoints import inbox_journal
from tierckpt.service.checkpoints.inbox_journal import (
    InboxJournal,
    Ref,
    pending_records,
)


def _record(step: int) -> str:
    return json.dumps({"step": step, "files": [["model.bin", 10, 123]]})


def _journals(directory: Path) -> list[Path]:
    return sorted(directory.glob("journal-*.log"))


def _recovered(directory: Path) -> tuple[InboxJournal, list[tuple[Ref, int]]]:
    journal = InboxJournal(directory)
    return journal, [(ref, json.loads(text)["step"]) for ref, text in journal.recover()]


def test_a_start_takes_up_the_records_not_marked_done_in_order(tmp_path: Path) -> None:
    first = InboxJournal(tmp_path)
    refs = {step: first.append(_record(step)) for step in (1, 2, 3, 4)}
    first.done(refs[2])
    first.done(refs[4])
    assert [r["step"] for r in pending_records(tmp_path)] == [1, 3]
    # The agent dies here (nothing closed). A new life appends to its own
    # journal, not to the earlier one.
    second, found = _recovered(tmp_path)
    assert [step for _ref, step in found] == [1, 3]
    second.append(_record(5))
    assert len(_journals(tmp_path)) == 2
    for ref, _step in found:
        second.done(ref)
    # Everything of the earlier life is done: its journal is gone.
    assert len(_journals(tmp_path)) == 1
    assert [r["step"] for r in pending_records(tmp_path)] == [5]
    second.close()
    third, found = _recovered(tmp_path)
    assert [step for _ref, step in found] == [5]
    third.done(found[0][0])
    assert _journals(tmp_path) == [] and pending_records(tmp_path) == []


def test_a_line_cut_off_by_a_kill_is_skipped_and_cut_away(tmp_path: Path) -> None:
    journal = InboxJournal(tmp_path)
    journal.append(_record(1))
    # A kill -9 between two pages of a write: the line has no end. Its
    # registration was never answered (the write had not returned).
    [path] = _journals(tmp_path)
    with open(path, "ab") as out:
        out.write(b"R 2 0badc0de " + _record(2).encode()[:10])
    again, found = _recovered(tmp_path)
    assert [step for _ref, step in found] == [1]
    assert path.read_bytes().endswith(b"\n")  # whole lines only, from here on
    # Its done mark reads back after the cut (no unreadable line made of it).
    again.done(found[0][0])
    again.close()
    _last, found = _recovered(tmp_path)
    assert found == [] and list(tmp_path.glob("unreadable-*")) == []


def test_an_unreadable_line_is_kept_aside_and_the_rest_taken_up(tmp_path: Path) -> None:
    journal = InboxJournal(tmp_path)
    for step in (1, 2, 3):
        journal.append(_record(step))
    [path] = _journals(tmp_path)
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"step": 2', b'"step": 9')  # its checksum no longer holds
    path.write_bytes(b"\n".join(lines))
    _again, found = _recovered(tmp_path)
    assert [step for _ref, step in found] == [1, 3]
    [kept] = tmp_path.glob("unreadable-*")
    assert b'"step": 9' in kept.read_bytes()


def test_a_record_that_cannot_be_parsed_is_set_aside_not_retried(tmp_path: Path) -> None:
    journal = InboxJournal(tmp_path)
    journal.append(_record(1))
    journal.append('{"not": "a registration"}')
    again = InboxJournal(tmp_path)
    found = list(again.recover())
    assert len(found) == 2
    ref, text = found[1]
    again.set_aside(ref, text, "KeyError: 'request'")  # what inbox.recover does with it
    [kept] = tmp_path.glob("unreadable-*")
    assert json.loads(kept.read_text()) == {"not": "a registration"}
    assert [r.get("step") for r in pending_records(tmp_path)] == [1]


def test_a_write_that_falls_short_leaves_no_partial_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = InboxJournal(tmp_path)
    journal.append(_record(1))
    real_write = os.write

    def half(fd: int, data: bytes) -> int:  # a disk that fills up mid-write
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(inbox_journal.os, "write", half)
    with pytest.raises(OSError, match="fell short"):
        journal.append(_record(2))
    monkeypatch.setattr(inbox_journal.os, "write", real_write)
    journal.append(_record(3))
    assert [r["step"] for r in pending_records(tmp_path)] == [1, 3]
    assert list(tmp_path.glob("unreadable-*")) == []


def test_the_journal_is_cut_back_when_idle_and_rotated_when_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inbox_journal, "TRUNCATE_BYTES", 100)
    monkeypatch.setattr(inbox_journal, "ROTATE_BYTES", 1000)
    journal = InboxJournal(tmp_path)
    refs = [journal.append(_record(step)) for step in range(3)]
    [path] = _journals(tmp_path)
    for ref in refs:
        journal.done(ref)
    assert path.stat().st_size == 0  # nothing pending, past TRUNCATE_BYTES: emptied
    # A stream that is never idle: a new journal past ROTATE_BYTES; the
    # earlier one goes once its last record is done.
    held = journal.append(_record(100))
    for step in range(20):
        journal.done(journal.append(_record(step)))
    assert len(_journals(tmp_path)) == 2
    journal.done(held)
    assert len(_journals(tmp_path)) == 1
    assert pending_records(tmp_path) == []


def test_records_of_an_older_agent_are_taken_up_and_removed(tmp_path: Path) -> None:
    (tmp_path / "00000000000000000001-00000001.json").write_text(_record(1))
    (tmp_path / ".00000000000000000002-00000001.json.abc").write_text("{")  # before its rename
    journal, found = _recovered(tmp_path)
    assert [step for _ref, step in found] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000000000000000001-00000001.json"]
    journal.done(found[0][0])
    assert list(tmp_path.iterdir()) == []
