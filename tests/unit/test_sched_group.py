"""The worker process's own scheduling group (service/sched_group.py), in a
process of its own: it starts a session, so an autogroup, niced above the
agent's, and the lock holder raises the group back while it holds SQLite's
write lock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt.service import sched_group

PROBE = """
import json, os
from tierckpt.service import lock_holder, sched_group

def group_nice():
    with open("/proc/self/autogroup") as f:
        return int(f.read().split()[-1])

agent = group_nice()
group = sched_group.detach(5)
out = {"leader": os.getsid(0) == os.getpid(), "agent": agent, "group": group is not None}
if group is not None:
    out["permitted"] = lock_holder.inherit_group_priority(group)
    out["niced"] = group_nice()
    held = lock_holder.holding()
    out["holding"] = group_nice()
    lock_holder.released(held)
    out["released"] = group_nice()
print(json.dumps(out))
"""


def test_the_worker_leaves_the_agents_group_niced_and_holds_the_lock_at_its_niceness() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(done.stdout)
    assert seen["leader"]  # a session of its own, wherever it runs
    if not sched_group.autogroups_on():
        assert not seen["group"]
        pytest.skip("this kernel schedules no autogroups: the session is all there is to see")
    assert seen["group"]
    assert seen["niced"] == min(19, seen["agent"] + 5)
    assert seen["released"] == seen["niced"]
    # Lowering a niceness back needs CAP_SYS_NICE; without it the group stays.
    assert seen["permitted"] == _may_lower_niceness()
    assert seen["holding"] == (seen["agent"] if seen["permitted"] else seen["niced"])


def _may_lower_niceness() -> bool:
    """CAP_SYS_NICE (bit 23) in this process's effective capabilities."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return False
