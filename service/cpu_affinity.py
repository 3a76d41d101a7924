"""The CPUs the agent's background work may run on (``[worker] cpus``).

Why: uploads keep cores busy (hashing, request signing, the kernel's
copies), and niceness only orders the turns on a shared core; confining the
background work to some cores leaves the others to the trainer's own work
(its data loaders, its input pipeline), as nodes are set up for data loaders
(Kubernetes' CPU manager, Slurm's cpusets do the same per job), and the
agent's requests, which run on any CPU, find a core the uploads do not
hold. It is the default (``auto``); what it costs the uploads' pace on
small nodes, and what it buys the calls, is measured side by side in
benchmarks/README.md.

The setting is a CPU list as the kernel writes one (``2``, ``2-5``,
``0,2,4-7``), read by ``parse``; ``auto`` (``background_share``: the
highest quarter of the agent's CPUs, none on a one-CPU agent; the
default); or ``all``. Linux keeps an affinity per thread and a
new thread inherits its creator's: the worker process applies it to its
threads first thing (``confine_process``), before its event loop or any
pool starts one, and the memory tier's T0 writer to itself
(``confine_thread``) in its pool's initializer. `tierckpt serve` refuses a
list of which the agent may use no CPU (``usable``) before it starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

log = logging.getLogger("tierckpt.cpu_affinity")

# The kernel's list format: numbers and ranges separated by commas.
_ITEM = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")
# More CPUs than any machine has; also bounds what a range can expand to.
MAX_CPU = 65535


def parse(text: str) -> frozenset[int]:
    """The CPUs of a list such as ``0,2,4-7``; empty text: none (no confinement).
    ValueError with what is wrong, for the configuration's refusal."""
    cpus: set[int] = set()
    for item in (part.strip() for part in text.split(",")) if text.strip() else ():
        match = _ITEM.match(item)
        if match is None:
            raise ValueError(
                f"{item!r} is not a CPU number or range: "
                "write a list such as '2', '2-5' or '0,2,4-7'"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"the range {item!r} ends before it starts")
        if last > MAX_CPU:
            raise ValueError(f"CPU {last} is out of range (at most {MAX_CPU})")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def background_share(allowed: frozenset[int]) -> frozenset[int]:
    """``cpus = "auto"``: the highest quarter of ``allowed`` (rounded up), so
    that the background gets at least one CPU of its own and the trainers and
    the agent's requests keep the rest; none when ``allowed`` is one CPU
    (nothing to keep apart). The highest because trainers, data loaders and
    NUMA-bound ranks are placed from CPU 0 up by default."""
    if len(allowed) < 2:
        return frozenset()
    share = -(-len(allowed) // 4)
    return frozenset(sorted(allowed)[-share:])


def allowed_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (empty where the platform has
    no affinities)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


def usable(wanted: frozenset[int]) -> frozenset[int]:
    """The CPUs of ``wanted`` this process may run on (its own affinity: a
    container's or job's cpuset). ValueError naming both when none is; on a
    platform without affinities, ``wanted`` (``confine_*`` then say it is
    not applied)."""
    allowed = allowed_cpus()
    if not allowed:  # no affinities on this platform
        return wanted
    chosen = wanted & allowed
    if not chosen:
        raise ValueError(
            f"[worker] cpus names CPUs {format_list(wanted)}, none of which this agent may run on "
            f"(it may run on {format_list(allowed)}): choose among those"
        )
    return chosen


def confine_thread(wanted: frozenset[int], what: str) -> frozenset[int] | None:
    """Confine the calling thread (and the threads it starts later) to the
    usable CPUs of ``wanted``; the CPUs applied, or None when ``wanted`` is
    empty or the platform has no affinity (logged: the work then runs
    anywhere, as without the setting)."""
    chosen = _applicable(wanted, what)
    if chosen is not None:
        os.sched_setaffinity(0, chosen)
        log.info("%s confined to CPUs %s", what, format_list(chosen))
    return chosen


def confine_process(wanted: frozenset[int], what: str) -> frozenset[int] | None:
    """As ``confine_thread``, for every thread the calling process has now
    (the ones it starts later inherit their creator's)."""
    chosen = _applicable(wanted, what)
    if chosen is not None:
        try:
            set_process_affinity("self", chosen)
        except OSError:  # no /proc: the calling thread at least
            os.sched_setaffinity(0, chosen)
        log.info("%s confined to CPUs %s", what, format_list(chosen))
    return chosen


def set_process_affinity(pid: int | str, cpus: frozenset[int] | set[int]) -> None:
    """Every thread process ``pid`` (or ``"self"``) has now on ``cpus``.
    FileNotFoundError when there is no such process."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def _applicable(wanted: frozenset[int], what: str) -> frozenset[int] | None:
    """The CPUs to apply: None for an empty list, or where the platform has
    no affinities (logged); ValueError as ``usable``."""
    if not wanted:
        return None
    if not hasattr(os, "sched_setaffinity"):
        log.warning("%s runs on any CPU: this platform cannot confine threads", what)
        return None
    return usable(wanted)


def format_list(cpus: frozenset[int]) -> str:
    """The kernel's list format, runs joined: {0, 1, 2, 5} -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"
