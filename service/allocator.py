"""Give part buffers back to the kernel as soon as they are freed.

The upload pipeline holds at most ``parts_in_flight × part_size`` bytes of
parts, but each part is a fresh 16 MiB ``bytes`` allocated in whichever
thread read it. glibc serves such blocks with mmap only until the first one
is freed: it then raises its mmap threshold (up to 32 MiB) and carves later
parts out of per-thread heap arenas, which keep the pages after ``free``, so
the resident set grows to several times the live parts. Fixing the threshold
(which also stops glibc from moving it) makes every large buffer an mmap that
``free`` returns at once; the cost is a page fault per 4 KiB of a part, small
next to reading and hashing it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tierckpt.allocator")

M_MMAP_THRESHOLD = -3  # from <malloc.h>
MMAP_THRESHOLD_BYTES = 1024 * 1024


def return_large_buffers_to_os() -> bool:
    """True when glibc accepted the setting (False on musl, macOS, …)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    accepted = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not accepted:
        log.warning("mallopt(M_MMAP_THRESHOLD) refused; part buffers may stay resident")
    return accepted
