"""Reading checkpoint files from local SSD safely.

A file is opened without following a final symlink and without blocking (a
FIFO swapped in after registration must not hang the agent), checked to be a
regular file under a configured root, and compared with what was registered:
size and mtime must not have changed, before and after the bytes are read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class SourceChanged(Exception):
    """The file is not what was registered any more (changed, gone, or replaced)."""


@dataclass(frozen=True)
class SourceFile:
    path: Path
    relative: str
    key: str
    size: int
    mtime_ns: int
    expected_sha256: str | None = None
    # The same bytes elsewhere, read first when still there: the memory
    # tier's segment of a checkpoint the agent is still writing to T0.
    # Returns an open descriptor or None.
    elsewhere: Callable[[], int | None] | None = None


def confine(path: Path, roots: list[Path]) -> Path:
    """Resolve ``path``; refuse it unless it lies under one of ``roots``."""
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved.is_relative_to(Path(os.path.realpath(root))):
            return resolved
    raise SourceChanged(f"{path} resolves to {resolved}, outside the configured local roots")


def open_checked(source: SourceFile, roots: list[Path]) -> int:
    if source.elsewhere is not None and (fd := source.elsewhere()) is not None:
        # Its size and mtime are the registered ones while it is that copy
        # (a freed segment's file handed out again is truncated: its mtime
        # moves, caught here or by the check after reading).
        try:
            check_unchanged(fd, source)
            return fd
        except SourceChanged:
            os.close(fd)
    resolved = confine(source.path, roots)
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise SourceChanged(f"{source.relative} disappeared after registration") from exc
    except OSError as exc:
        raise SourceChanged(f"{source.relative} cannot be opened: {exc.strerror}") from exc
    try:
        check_unchanged(fd, source)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(fd: int, source: SourceFile) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SourceChanged(f"{source.relative} is no longer a regular file")
    if info.st_size != source.size or info.st_mtime_ns != source.mtime_ns:
        raise SourceChanged(
            f"{source.relative} changed after registration (size {source.size} -> "
            f"{info.st_size}, mtime {source.mtime_ns} -> {info.st_mtime_ns})"
        )


def read_into(fd: int, offset: int, view: memoryview, source: SourceFile) -> None:
    """Fill ``view`` from ``offset`` (no allocation: the caller owns the buffer)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise SourceChanged(f"{source.relative} was truncated after registration")
        got += n
