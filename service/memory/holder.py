"""Whether a reserved segment's trainer is still there, without its pid.

A reservation is freed when it is registered, given back, or its lease
(``[memory] lease_seconds``, long enough for a slow copy) ends. A trainer
killed -9 between saves leaves its segment reserved ahead for the next
save, the size of a whole state, for the rest of that lease, and the
restarted trainer's saves meet an arena short of that much. The trainer
therefore holds a lock on the segment's ``holder`` file while it holds the
segment (client/torch/segment_holds.py). The kernel drops a flock when the
last descriptor of the process that took it closes, however that process
ends, and the lock is seen across pid namespaces (the trainer and the agent
in containers of one pod), where a pid could not be checked.

The holder takes its lock on a file of another name and renames it to
``holder`` only then: a ``holder`` file is always one that was locked, so a
free lock on it means its trainer is gone. No ``holder`` file (a client
that does not take the lock, or one between the answer and its lock): the
lease alone decides, as before.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

HOLDER = "holder"


def holder_gone(directory: Path) -> bool:
    """True when the segment in ``directory`` had a holder and has none now."""
    try:
        fd = os.open(directory / HOLDER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # never held (or the segment is gone already)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: its trainer holds it
        return False
    finally:
        os.close(fd)  # also lets go of the lock taken just now
    return True
