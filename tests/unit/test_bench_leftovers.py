"""The benchmark's watchdog: a benchmark killed with SIGKILL (as the OOM
killer does) leaves no process it started and nothing in /dev/shm.

Real processes: a stand-in benchmark calls ``leftovers.watch``, starts a
child in a session of its own (as the agents and SeaweedFS servers are) and
writes a /dev/shm entry named after its work directory; then it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks import leftovers

REPO = Path(__file__).resolve().parents[2]

QUITTER = (
    "import os, time\n"
    "parent = os.getppid()\n"
    "print('watching', flush=True)\n"
    "while os.getppid() == parent: time.sleep(0.05)\n"
    "time.sleep(0.3)\n"
)

BENCH = """
import subprocess, sys
from tests.unit.test_bench_leftovers import QUITTER
from pathlib import Path
from benchmarks import leftovers
work = Path(sys.argv[1])
leftovers.watch(work, keep=sys.argv[2] == "keep")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
# As multiprocessing's resource tracker: exits on its own once the benchmark has.
quitter = subprocess.Popen([sys.executable, "-c", QUITTER], start_new_session=True,
                           stdout=subprocess.PIPE)
quitter.stdout.readline()  # it knows its parent: the benchmark may be killed now
(Path("/dev/shm") / f"{work.name}-segment").write_bytes(b"x" * 4096)
print(child.pid, quitter.pid, flush=True)
import time; time.sleep(600)
"""

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the stand-in is reaped by init; a zombie is gone too.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _eventually(check: Callable[[], bool], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("keep", [False, True])
def test_a_sigkilled_benchmark_leaves_no_process_and_nothing_in_dev_shm(
    tmp_path: Path, keep: bool
) -> None:
    work = tmp_path / f"tierckpt-bench-{uuid.uuid4().hex[:10]}"
    work.mkdir()
    (work / "catalog.db").write_bytes(b"")
    segment = Path("/dev/shm") / f"{work.name}-segment"
    # The watchdog and the child inherit the stand-in's pipes: they reach
    # their end once all three have exited, the watchdog last.
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(work), "keep" if keep else "no"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert bench.stdout is not None
        child, quitter = map(int, bench.stdout.readline().split())
        assert _alive(child) and segment.exists()
        # A process just exec'd shows its environment a moment later
        # (Popen can return before the kernel has set it up).
        assert _eventually(lambda: {child, quitter} <= set(leftovers.marked(work)))

        bench.send_signal(signal.SIGKILL)
        _, said = bench.communicate(timeout=30)  # the watchdog has done its work

        assert not _alive(child), "the benchmark's child outlived it"
        assert not segment.exists(), "its /dev/shm entry stayed"
        assert work.exists() is keep
        assert f"killed {child} (" in said
        # One that exits on its own within the grace is not a leftover.
        assert not _alive(quitter)
        assert f"killed {quitter} " not in said
    finally:
        if child and _alive(child):  # a failed test: the child holds the pipes too
            os.kill(child, signal.SIGKILL)
        bench.kill()
        bench.communicate(timeout=30)
        segment.unlink(missing_ok=True)


def test_the_watchdog_touches_only_its_own_runs_entries(tmp_path: Path) -> None:
    work = tmp_path / f"tierckpt-bench-{uuid.uuid4().hex[:10]}"
    work.mkdir()
    # As after a normal end: nothing marked runs, nothing of this run is in
    # /dev/shm. Nothing is done, and another run's entry is not touched.
    other = Path("/dev/shm") / f"tierckpt-bench-other-{uuid.uuid4().hex[:10]}"
    other.write_bytes(b"")
    try:
        assert leftovers.clean(work, keep=True) == []
        assert other.exists()
    finally:
        other.unlink()
