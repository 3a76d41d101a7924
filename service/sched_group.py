"""The worker process in a scheduling group of its own, niced as a whole.

Linux's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, on in most
distributions' kernels; they apply to processes outside a cgroup of the cpu
controller) schedule every session as one group: the CPU is shared between
the groups first, and a niceness only weighs a process against the others of
its own session. A worker process left in the agent's session is niced
against the agent alone, while the two together take one group's turn beside
the store's, the trainer's and every other session's, and the agent wakes
for each request into a group its own worker keeps busy. So the worker
process starts a session of its own (``detach``) and nices that group
(``/proc/self/autogroup``) ``[worker] process_nice`` above the agent's; the
agent is then a group of its own, mostly idle, whose requests take a CPU
first. Measured in benchmarks/README.md ("the worker's own scheduling
group").

A niced group also holds SQLite's write lock niced: lock_holder.py raises
the group to the agent's group's niceness while one of its threads holds
it, as it does the thread's own niceness. Lowering either needs
CAP_SYS_NICE; without it the group stays niced and the log says so once.

Where autogroups are off or absent (a cgroup of the cpu controller: most
containers, Slurm's cgroup plugin), the new session changes nothing and the
process's own niceness does what it always did.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("tierckpt.worker")

_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
_OWN = Path("/proc/self/autogroup")


def autogroups_on() -> bool:
    try:
        return _ENABLED.read_text().strip() == "1" and _OWN.exists()
    except OSError:
        return False


def _niceness() -> int:
    """The niceness of this process's autogroup (``/autogroup-N nice K``)."""
    try:
        return int(_OWN.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _set(nice: int) -> bool:
    try:
        _OWN.write_text(str(nice))
    except OSError:
        return False
    return True


class Detached:
    """The worker process's own group, at ``worker``; ``agent``: the agent's."""

    def __init__(self, agent: int, worker: int) -> None:
        self.agent, self.worker = agent, worker

    def may_raise(self) -> bool:
        """Whether the OS lets the group take the agent's niceness back:
        tried once here (and put back), so that a lock holder without
        CAP_SYS_NICE does not try again, and fail, on every transaction."""
        if self.agent >= self.worker:
            return False
        permitted = _set(self.agent)
        _set(self.worker)
        if not permitted:
            log.info(
                "the worker process's scheduling group stays at niceness %d while it holds "
                "the catalog's lock (the agent's %d needs CAP_SYS_NICE)",
                self.worker,
                self.agent,
            )
        return permitted

    def raise_to_agent(self) -> None:
        _set(self.agent)

    def back_to_worker(self) -> None:
        _set(self.worker)


def detach(added: int) -> Detached | None:
    """Start a session (so an autogroup) of this process's own, niced
    ``added`` above the agent's group; None where the kernel schedules no
    autogroups. The process stays in the agent's cgroup and dies with it as
    before (``PR_SET_PDEATHSIG`` does not depend on the session)."""
    agent = _niceness()  # still the agent's session
    try:
        os.setsid()
    except OSError:  # a session leader already
        pass
    if not autogroups_on():
        return None
    group = Detached(agent, min(19, agent + added))
    if not _set(group.worker):  # raising a niceness needs no privilege
        return None
    return group
