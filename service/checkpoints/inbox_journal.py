"""The registration inbox's records on the node's SSD: append-only journals.

A registration answered from the inbox (inbox.py) must be on the node before
its answer and stay there until the catalog has it. A file per record
(created, renamed into place, removed after the catalog's commit) cost the
register about 1 ms of file-system work here, most of the agent's time in
the call (benchmarks/README.md, "Issue 16 on a fourteenth machine"); an
append to a file held open costs one small write.

Layout: ``journal-<ns>.log`` files in the inbox's directory, one line each
of

* ``R <seq> <crc32> <record JSON>``: a registration recorded (the record is
  inbox.to_record's, its CRC-32 in hex);
* ``D <seq>``: that registration is in the catalog (or refused by it).

A record's ``D`` line goes to the file of its ``R``, so each file stands on
its own. Every start of the agent appends to a journal of its own, never
to an earlier life's: a kill -9 can leave that one's last line cut off (a
write interrupted between two pages), which recovery skips; it was never
answered, its write had not returned. A file is removed once every record
in it is done, and the current one is cut back to empty when it is large
and nothing in it is pending (so it does not grow without end).

Only the event loop's thread writes here (the inbox's rule: small records
on the loop, a large one's JSON encoded in a thread, then appended on the
loop), so appends never interleave. Like the files before, nothing is
fsynced: a record survives a kill -9 of the agent (it is in the page
cache), not a power loss before the catalog's own flush.

Records written by an older agent, a ``.json`` file each, are taken up as
before (removed once in the catalog).
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tierckpt.register")

JOURNAL_PREFIX = "journal-"
JOURNAL_SUFFIX = ".log"
LEGACY_SUFFIX = ".json"
UNREADABLE_PREFIX = "unreadable-"
# The current journal is cut back to empty when nothing in it is pending
# and it holds more than this; a new one is started past ROTATE_BYTES
# whatever is pending (the old one goes once its records are done).
TRUNCATE_BYTES = 1 << 20
ROTATE_BYTES = 16 << 20


@dataclass(eq=False)
class _Journal:
    path: Path
    fd: int
    size: int
    pending: int = 0
    current: bool = False


@dataclass(frozen=True)
class Ref:
    """Where a record is: a line of a journal, or an older agent's file."""

    seq: int
    journal: _Journal | None = field(default=None)
    legacy: Path | None = field(default=None)


def _line(seq: int, text: str) -> bytes:
    data = text.encode()
    return b"R %d %08x " % (seq, zlib.crc32(data)) + data + b"\n"


def _parse(path: Path) -> tuple[dict[int, str], list[bytes], int | None]:
    """The records of ``path`` not marked done (seq -> JSON, in order), the
    lines that cannot be read, and where its whole lines end when its last
    one was cut off (else None). Read a line at a time."""
    records: dict[int, str] = {}
    bad: list[bytes] = []
    offset = 0
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):  # a cut-off write: always the last
                return records, bad, offset
            offset += len(raw)
            line = raw[:-1]
            kind, _, rest = line.partition(b" ")
            try:
                if kind == b"D":
                    records.pop(int(rest), None)
                    continue
                if kind != b"R":
                    raise ValueError("unknown line")
                seq, crc, data = rest.split(b" ", 2)
                if int(crc, 16) != zlib.crc32(data):
                    raise ValueError("checksum")
                records[int(seq)] = data.decode()
            except ValueError:
                bad.append(line)
    return records, bad, None


def _is_journal(name: str) -> bool:
    return name.startswith(JOURNAL_PREFIX) and name.endswith(JOURNAL_SUFFIX)


def _is_legacy(name: str) -> bool:
    """An older agent's record file (not one kept aside as unreadable)."""
    return name.endswith(LEGACY_SUFFIX) and not name.startswith(UNREADABLE_PREFIX)


class InboxJournal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._current: _Journal | None = None
        self._open: set[_Journal] = set()  # the current one and earlier lives' with records left
        self._seq = 0

    # -- a start ---------------------------------------------------------------------------

    def recover(self) -> Iterator[tuple[Ref, str]]:
        """The records an earlier life left, as (ref, JSON text), in their
        order; each must be ``done`` (or ``set_aside``) in turn. Old
        journals with nothing pending are removed here."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.iterdir()):
            name = path.name
            if name.startswith("."):
                path.unlink(missing_ok=True)  # an older agent's record cut off before its rename
            elif _is_journal(name):
                yield from self._recover_journal(path)
            elif _is_legacy(name):
                try:
                    text = path.read_text()
                except OSError as exc:
                    text = f"unreadable: {exc}"  # set aside by the caller
                yield Ref(0, legacy=path), text

    def _recover_journal(self, path: Path) -> Iterator[tuple[Ref, str]]:
        records, bad, whole = _parse(path)
        if whole is not None:
            log.info("inbox: %s ends in a record cut off before its answer; skipped", path.name)
        if bad:
            kept = path.with_name(f"{UNREADABLE_PREFIX}{path.name}")
            with open(kept, "ab") as out:
                out.write(b"\n".join(bad) + b"\n")
            log.error(
                "inbox: %d line(s) of %s cannot be read; kept in %s", len(bad), path, kept.name
            )
        if not records:
            path.unlink(missing_ok=True)
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        if whole is not None:
            os.ftruncate(fd, whole)  # done marks go after whole lines only
        journal = _Journal(path, fd, os.fstat(fd).st_size, pending=len(records))
        self._open.add(journal)
        for seq, text in records.items():
            yield Ref(seq, journal), text

    # -- records ---------------------------------------------------------------------------

    def append(self, text: str) -> Ref:
        """Record ``text`` (JSON, one line); OSError if the SSD refused it
        (then nothing of it is left in the journal)."""
        journal = self._journal()
        self._seq += 1
        self._write(journal, _line(self._seq, text))
        journal.pending += 1
        return Ref(self._seq, journal)

    def done(self, ref: Ref) -> None:
        """The record is in the catalog (or refused): not taken up again."""
        if ref.legacy is not None:
            ref.legacy.unlink(missing_ok=True)
            return
        journal = ref.journal
        assert journal is not None
        journal.pending -= 1
        try:
            if journal.pending == 0 and not journal.current:
                self._remove(journal)
            elif journal.pending == 0 and journal.size > TRUNCATE_BYTES:
                os.ftruncate(journal.fd, 0)
                journal.size = 0
            else:
                self._write(journal, b"D %d\n" % ref.seq)
        except OSError as exc:
            # Taken up again at the next start: answered as already registered.
            log.warning("inbox: cannot mark a record of %s done (%s)", journal.path, exc)

    def set_aside(self, ref: Ref, text: str, reason: str) -> None:
        """A record that cannot be taken up: kept for an operator (never retried)."""
        if ref.legacy is not None:
            name = ref.legacy.name
        else:
            assert ref.journal is not None
            name = f"{ref.journal.path.stem}-{ref.seq}.json"
        kept = self.directory / f"{UNREADABLE_PREFIX}{name}"
        log.error("inbox record %s cannot be read (%s); kept as %s", name, reason, kept)
        if ref.legacy is not None:
            ref.legacy.rename(kept)
            return
        kept.write_text(text)
        self.done(ref)

    def close(self) -> None:
        """Close the files (what is pending in them stays for the next start)."""
        for journal in self._open:
            os.close(journal.fd)
        self._open.clear()
        self._current = None

    # -- files -----------------------------------------------------------------------------

    def _journal(self) -> _Journal:
        current = self._current
        if current is not None and current.size < ROTATE_BYTES:
            return current
        if current is not None:
            current.current = False
            if current.pending == 0:
                self._remove(current)
        path = self.directory / f"{JOURNAL_PREFIX}{time.time_ns():020d}{JOURNAL_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        self._current = _Journal(path, fd, 0, current=True)
        self._open.add(self._current)
        return self._current

    def _write(self, journal: _Journal, data: bytes) -> None:
        try:
            written = os.write(journal.fd, data)
        except OSError:
            written = -1
        if written == len(data):
            journal.size += written
            return
        # Short (a full disk) or failed: cut the partial line off again.
        os.ftruncate(journal.fd, journal.size)
        raise OSError(f"journal {journal.path.name}: a write of {len(data)} bytes fell short")

    def _remove(self, journal: _Journal) -> None:
        self._open.discard(journal)
        os.close(journal.fd)
        journal.path.unlink(missing_ok=True)


def pending_records(directory: Path) -> list[dict[str, Any]]:
    """The records in ``directory`` not done yet (journals and older files),
    read without changing anything: what a start would take up."""
    out: list[dict[str, Any]] = []
    for path in sorted(directory.iterdir()) if directory.exists() else ():
        if _is_journal(path.name):
            out.extend(json.loads(text) for text in _parse(path)[0].values())
        elif _is_legacy(path.name):
            out.append(json.loads(path.read_text()))
    return out
