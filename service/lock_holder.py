"""What a holder of SQLite's write lock does for the writers waiting for it.

Every write transaction holds the catalog's one write lock, and a trainer's
registration may be waiting for it. Two things outside the transaction's own
statements could stretch that hold far past them; the holder prevents both
for as long as it holds the lock (``holding`` to ``released``):

* **The garbage collector.** A full collection stops every thread of the
  process for tens of milliseconds or more; one that falls inside a
  transaction holds the lock all along. Automatic collection waits until
  the lock is released (it runs at the next allocation after).
* **A niceness below the agent's** (the worker process runs niced,
  ``[worker] process_nice``, so that the agent's requests get a CPU first).
  A registration waiting for a lock a niced thread holds waits until the
  scheduler gives that thread enough CPU to finish, or to give way
  (write_gate.py), behind every un-niced process meanwhile: a priority
  inversion, which SQLite's lock does nothing against. So the holding thread
  of the worker process (its event loop's: its transactions run inline,
  sqlite_driver.py) takes the agent's niceness back until it releases.
  Lowering a niceness needs CAP_SYS_NICE or a high enough RLIMIT_NICE (root
  outside a container; a container needs the capability); without either it
  keeps its own, and the log says so once when the worker process starts.
  On Linux a niceness belongs to a thread: only the holder's changes.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger("tierckpt.worker")


@dataclass(frozen=True)
class _Nice:
    agent: int  # the niceness the agent runs at
    worker: int  # the worker process's own


_NICE: _Nice | None = None
# Holders in this process (the event loop's transaction and the registration
# writer's may overlap a moment): the collector waits for the last.
_holders = 0
_holders_lock = threading.Lock()
_collector_was_on = False


@dataclass(frozen=True)
class Held:
    thread: int | None  # raised to the agent's niceness, to restore


def inherit_priority(agent: int, worker: int) -> bool:
    """In the worker process, niced from ``agent`` to ``worker``: from now on
    its lock holders run at ``agent``; False if the OS does not permit it."""
    global _NICE
    if worker <= agent:
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, 0, agent)
        os.setpriority(os.PRIO_PROCESS, 0, worker)
    except OSError as exc:
        log.info(
            "the worker's catalog lock holders keep niceness %d (the agent's %d "
            "needs CAP_SYS_NICE): %s",
            worker,
            agent,
            exc,
        )
        return False
    _NICE = _Nice(agent, worker)
    return True


def holding() -> Held:
    """The calling thread now holds the write lock."""
    global _holders, _collector_was_on
    with _holders_lock:
        _holders += 1
        if _holders == 1:
            _collector_was_on = gc.isenabled()
            gc.disable()
    nice = _NICE
    if nice is None:
        return Held(None)
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, nice.agent)
    except OSError:
        return Held(None)
    return Held(thread)


def released(held: Held) -> None:
    """The lock ``holding`` reported is released."""
    global _holders
    with _holders_lock:
        _holders -= 1
        if _holders == 0 and _collector_was_on:
            gc.enable()
    nice = _NICE
    if held.thread is None or nice is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, held.thread, nice.worker)
    except OSError as exc:  # the thread is gone: nothing left to restore
        log.debug("could not restore the niceness of thread %d: %s", held.thread, exc)
