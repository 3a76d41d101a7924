"""CPU time and memory of another process, from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

from tierckpt.service.cpu_affinity import set_process_affinity

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads) so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces: split after its ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat
    return (utime + stime) / _TICKS


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak resident set) of `pid`, in KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def tree_memory_kib(pid: int) -> dict[str, int]:
    """:func:`memory_kib` summed over `pid` and its direct children now
    running: the agent and its worker process, which holds the upload
    buffers. The sum of the peaks bounds the peak of the sum."""
    total = memory_kib(pid)
    for child in child_pids(pid):
        try:
            mine = memory_kib(child)
        except OSError:
            continue  # exited meanwhile
        total = {key: total.get(key, 0) + mine.get(key, 0) for key in ("VmRSS", "VmHWM")}
    return total


def self_cpu_seconds() -> float:
    """CPU seconds of this process, all threads (boto3's transfer threads included)."""
    times = os.times()
    return times.user + times.system


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (the agent's worker process, when it has
    one), whichever of its threads started them: the kernel lists a child
    under the thread that forked it."""
    pids: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return pids


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and of its direct children now running."""
    total = cpu_seconds(pid)
    for child in child_pids(pid):
        try:
            total += cpu_seconds(child)
        except OSError:
            continue  # exited meanwhile
    return total


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) ticks of the machine's CPUs so far (/proc/stat's cpu line):
    steal is the time a virtual machine's CPUs were ready to run and the
    hypervisor ran something else."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(f) for f in fields[:8]]  # guest time is already in user
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the CPUs' time stolen between two ``cpu_ticks`` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def meminfo_bytes(key: str) -> int | None:
    """A line of /proc/meminfo (``MemTotal``, ``MemAvailable``: memory the
    kernel can give without swapping; near zero it reclaims the page cache of
    every process, code and catalog included, and any call may wait for a
    page) in bytes; None where there is no such line or file."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    return None


def confine(pid: int | None, cpus: set[int] | frozenset[int]) -> frozenset[int] | None:
    """Every thread of ``pid`` on ``cpus`` (threads it starts later inherit
    their creator's); the CPUs its main thread had, to give back, or None
    when there is no such process."""
    if pid is None:
        return None
    try:
        before = frozenset(os.sched_getaffinity(pid))
        set_process_affinity(pid, cpus)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return before
