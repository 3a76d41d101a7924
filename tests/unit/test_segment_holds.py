"""A reserved segment's holder lock (client/torch/segment_holds.py,
service/memory/holder.py), with real processes: the agent's arena frees a
reservation whose trainer held it and died (kill -9) without waiting for
its lease, and never one whose holder is alive, one nobody locked, or one
already registered."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierckpt.client.models import MemorySegment
from tierckpt.service.memory.arena import Arena, Segment

pytest.importorskip("torch")  # the package of SegmentHolds imports it

from tierckpt.client.torch.segment_holds import SegmentHolds

HOLD_AND_SLEEP = """
import sys, time
from tierckpt.client.models import MemorySegment
from tierckpt.client.torch.segment_holds import SegmentHolds
holds = SegmentHolds()
holds.hold(MemorySegment(id=sys.argv[1], path=sys.argv[2], bytes=1, holder=sys.argv[3]))
print("held" if holds.held() else "not held", flush=True)
time.sleep(600)
"""


def _out(segment: Segment) -> MemorySegment:
    return MemorySegment(
        id=segment.id, path=str(segment.data), bytes=segment.nbytes, holder=str(segment.holder)
    )


def _holder_process(segment: Segment) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_SLEEP, segment.id, str(segment.data), str(segment.holder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL
    assert child.stdout is not None
    child.stdout.close()


@pytest.fixture
def arena(tmp_path: Path) -> Arena:
    made = Arena(tmp_path / "arena", budget=10_000, lease_seconds=600)
    made.open()
    return made


def test_a_reservation_whose_holder_is_killed_is_freed_before_its_lease(arena: Arena) -> None:
    held = arena.reserve("r", None, 0, 1, {"a.bin": 100})  # reserved ahead: no step
    child = _holder_process(held)
    try:
        assert arena.reclaim_abandoned() == []
        assert held.id in arena.segments
    finally:
        _kill(child)
    assert arena.reclaim_abandoned() == [held.id]
    assert not held.directory.exists()
    # Its room is the next reservation's (its files are unlinked).
    assert arena.used == 0
    arena.reserve("r", 7, 0, 1, {"a.bin": 100})
    assert arena.used == 100


def test_a_live_holder_unlocked_or_registered_segment_is_kept(arena: Arena) -> None:
    never_held = arena.reserve("r", 1, 0, 1, {"a.bin": 10})
    alive = arena.reserve("r", 2, 0, 1, {"a.bin": 10})
    staged = arena.reserve("r", 3, 0, 1, {"a.bin": 10})
    (staged.data / "a.bin").write_bytes(b"x" * 10)
    holds = SegmentHolds()  # this process: alive throughout
    holds.hold(_out(alive))
    holds.hold(_out(staged))
    arena.stage(staged, {"run": "r", "step": 3, "path": "/t0/r/step-3"})
    holds.let_go(staged.id)  # registered, then let go: the agent's now
    child_of = arena.reserve("r", 4, 0, 1, {"a.bin": 10})
    child = _holder_process(child_of)
    try:
        assert arena.reclaim_abandoned() == []
        assert {never_held.id, alive.id, staged.id, child_of.id} <= set(arena.segments)
        # A holder that lets go while alive (the checkpointer gave it back,
        # say) frees it as well; the lease still frees the one never held.
        holds.let_go(alive.id)
        assert arena.reclaim_abandoned() == [alive.id]
        assert arena.reclaim_abandoned(now=time.time() + 601) == [never_held.id, child_of.id]
    finally:
        _kill(child)
    assert list(arena.segments) == [staged.id]


def test_a_holder_that_cannot_be_made_leaves_the_lease_alone(tmp_path: Path) -> None:
    holds = SegmentHolds()
    gone = tmp_path / "no-such-segment" / "holder"
    holds.hold(MemorySegment(id="x", path=str(tmp_path), bytes=1, holder=str(gone)))
    holds.hold(MemorySegment(id="y", path=str(tmp_path), bytes=1))  # an older agent: no holder
    assert holds.held() == []
    holds.close()
