"""The agent's malloc setting: large freed buffers leave the resident set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    if sys.argv[1] == "on":
        from tierckpt.service.allocator import return_large_buffers_to_os
        assert return_large_buffers_to_os()

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    fd = os.open("/dev/zero", os.O_RDONLY)
    # What the upload pipeline does: 16 MiB parts read in pool threads,
    # a few alive at a time, freed after sending.
    def part(_):
        data = os.pread(fd, 16 << 20, 0)
        return len(data)
    with ThreadPoolExecutor(8) as pool:
        for _ in range(6):
            list(pool.map(part, range(8)))
    print(rss_kib())
    """
)


def rss_after(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_part_buffers_leave_the_resident_set() -> None:
    on = rss_after("on")
    # 48 parts of 16 MiB went through 8 threads; none is alive any more.
    assert on < 100 * 1024, f"{on} KiB still resident after every part was freed"
