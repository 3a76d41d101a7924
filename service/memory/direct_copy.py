"""A segment's file written to T0 around the page cache (O_DIRECT).

The memory tier writes each staged checkpoint to T0 while the same
checkpoint uploads from the segment, and both run on the node's cores. A
copy through the page cache (copy_file_range, sendfile) costs a kernel
memcpy per byte, then the writeback of as many dirty pages by the kernel's
flusher threads (at their own priority, not the niced writer's). A direct
write from a mapping of the segment hands the disk the tmpfs pages to read
by DMA: on the benchmark machine 2 GB took 0.15 s of CPU instead of 0.63–0.71
(plus the writeback's), and 1.0 s instead of 1.3–1.4 s. It also leaves no
gigabytes of dirty pages to crowd the page cache the node's other work uses.

The bytes written are the same either way, and the caller fsyncs either way
(the file's size and metadata, the tail, the disk's cache). Where the
filesystem refuses O_DIRECT (EINVAL at open or at a write: some network,
FUSE and older filesystems), the copy goes through the page cache as before.
The unaligned tail (the last partial block) is always written that way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path

from ..storage.posix import kernel_copy

# Direct writes must start at, and span, whole logical blocks of the device;
# 4 KiB is a multiple of every common one (512 B, 4 KiB). A mapping's pages
# are 4 KiB-aligned, which O_DIRECT also needs of the memory it reads.
ALIGN = 4096
CHUNK = 8 << 20  # per write: large enough for full disk bandwidth
_DIRECT = getattr(os, "O_DIRECT", 0)


def create(path: Path) -> int:
    """Create ``path`` (it must not exist) for writing, direct when the
    filesystem allows it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644)


def is_direct(fd: int) -> bool:
    return bool(_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _DIRECT)


def copy(src: int, dst: int, size: int) -> None:
    """The first ``size`` bytes of ``src`` into ``dst`` (from :func:`create`)."""
    if size == 0:
        return
    if not is_direct(dst):
        kernel_copy(src, dst, size)
        return
    with mmap.mmap(src, size, prot=mmap.PROT_READ) as mapped:
        done = _write_direct(mapped, dst, size - size % ALIGN)
        # The tail, and the rest after a refusal, through the page cache.
        fcntl.fcntl(dst, fcntl.F_SETFL, fcntl.fcntl(dst, fcntl.F_GETFL) & ~_DIRECT)
        while done < size:
            done += _write(mapped, dst, done, size)


def _write_direct(mapped: mmap.mmap, dst: int, aligned: int) -> int:
    """Direct writes of ``mapped`` up to ``aligned``; how far they got (less
    when the filesystem refused one: EINVAL, a device with larger blocks)."""
    done = 0
    try:
        while done < aligned:
            done += _write(mapped, dst, done, min(aligned, done + CHUNK))
            if done % ALIGN:  # a short write off the block grid: no more direct
                break
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    return done


def _write(mapped: mmap.mmap, dst: int, start: int, end: int) -> int:
    # The kernel reads the mapped pages itself (a segment truncated meanwhile
    # is an EFAULT here, never a SIGBUS in this process).
    with memoryview(mapped)[start:end] as part:
        written = os.pwrite(dst, part, start)
    if written <= 0:
        raise OSError(errno.EIO, f"the write at {start} wrote nothing")
    return written
