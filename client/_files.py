"""Making files durable: fsync of files, directories and descriptors (the
client's checkpoint and restore writes, and the service's POSIX store).

A file written and renamed into place survives a crash only once its data,
and the directory entry that names it, are on disk.
"""

from __future__ import annotations

import os


def fsync_file(path: str | os.PathLike[str]) -> None:
    fsync_close(os.open(path, os.O_RDONLY))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (created, renamed) durable."""
    fsync_close(os.open(path, os.O_RDONLY | os.O_DIRECTORY))


def fsync_close(fd: int) -> None:
    """fsync the open file ``fd``, then close it (closed even when fsync fails)."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
