"""Writing downloaded ranges into their files.

Ranges arrive out of order into reused, page-aligned buffers
(:class:`RangeBuffers`) and are written in place with ``pwrite``: with
O_DIRECT straight from those buffers where the filesystem has it (a buffered
write copies every byte into page-cache pages, which are slow to touch on
fresh memory), else buffered with a writeback hint per range. Each file is
preallocated first, so a full disk answers before the download starts.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Buffer = bytes | bytearray | memoryview


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _libc(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A libc function (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_SYNC_FILE_RANGE = _libc(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
SYNC_FILE_RANGE_WRITE = 2
# fallocate(2), not posix_fallocate(3): where the filesystem cannot
# preallocate, glibc's posix_fallocate writes zeros over the whole file.
_FALLOCATE = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def preallocate(fd: int, size: int) -> bool:
    """Reserve the file's blocks up front, in one extent where the filesystem can.

    Ranges land out of order and are written back as they arrive
    (:func:`start_writeback`), so without this ext4 allocates blocks range
    by range at writeback, in the restoring process, which costs system CPU
    on a disk with a long history of writes. A full disk answers here,
    before a byte is downloaded (ENOSPC is raised); a filesystem that cannot
    preallocate is only slower (False)."""
    if _FALLOCATE is None or size <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(error, os.strerror(error))
    return False  # EOPNOTSUPP, ENOSYS, EINVAL...


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk
    now, without waiting and without dropping them from the page cache.

    A restore ends with an fsync of every file. Left alone, the kernel starts
    writing dirty pages only after ~30 s or once 10 % of memory is dirty, so
    a restore would write nothing until that fsync and then wait for all of
    it after the last byte had arrived. Started per range, the writes overlap
    the download and the fsync finds little left. Only a hint: the fsync is
    still what makes the file durable, so a failure here is ignored (False)."""
    if _SYNC_FILE_RANGE is None or length <= 0:
        return False
    return _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0


def write_range(fd: int, data: Buffer, offset: int) -> None:
    pwrite_all(fd, data, offset)
    start_writeback(fd, offset, len(data))


# O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's
# logical block; a page covers every device this runs on.
ALIGNMENT = mmap.PAGESIZE
RangeBuffer = bytearray | mmap.mmap


def write_unbuffered(fd: int, buffer: RangeBuffer, length: int, offset: int, size: int) -> None:
    """Write ``buffer[:length]`` at ``offset`` of a file opened with O_DIRECT.

    Every range but a file's last is a whole number of pages; the last is
    written padded to the next page (the buffer is a range long, a page
    multiple) and the file cut back to ``size``, its true length."""
    padded = -(-length // ALIGNMENT) * ALIGNMENT
    pwrite_all(fd, memoryview(buffer)[:padded], offset)
    if padded != length:
        os.ftruncate(fd, size)


def open_target(target: Path, unbuffered: bool = False) -> tuple[int, bool]:
    """The file's descriptor, and whether it bypasses the page cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    direct_flag = getattr(os, "O_DIRECT", 0)
    if unbuffered and direct_flag:
        try:
            return os.open(target, flags | direct_flag, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a filesystem without O_DIRECT
                raise
    return os.open(target, flags, 0o644), False


# Range buffers kept between restores (and the DCP reader's reads) of one
# process, up to this many bytes: fresh anonymous memory costs a page fault
# per page on first touch and its unmapping at the end, which on some VMs was
# a third of a restore's time; reused pages cost neither. A process that
# never restores again keeps at most this much.
IDLE_BYTES = 128 * 1024 * 1024
_IDLE: dict[int, list[RangeBuffer]] = {}


def _idle_bytes() -> int:
    return sum(size * len(buffers) for size, buffers in _IDLE.items())


class RangeBuffers:
    """Range buffers, reused: a fresh bytearray per range costs its
    zero-filling and a page fault per page, more CPU than copying the data
    in. At most the fetch window's worth exist at once (the window semaphore
    bounds them); ``close`` hands them to the next download of the process
    (``IDLE_BYTES`` at most). Anonymous mmaps, so they are page-aligned, as
    O_DIRECT writes need."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[RangeBuffer] = []

    def take(self) -> RangeBuffer:
        if self._free:
            return self._free.pop()
        try:
            # pop() is atomic: downloads in other threads share the list.
            return _IDLE.get(self.size, []).pop()
        except IndexError:
            return mmap.mmap(-1, self.size)

    def give(self, buffer: RangeBuffer) -> None:
        self._free.append(buffer)

    def close(self) -> None:
        """Keep the free buffers for the next download, up to ``IDLE_BYTES``."""
        while self._free:
            buffer = self._free.pop()
            if _idle_bytes() + self.size <= IDLE_BYTES:
                _IDLE.setdefault(self.size, []).append(buffer)
            # else dropped: unmapped once no view of it is left
