"""What a benchmark killed with SIGKILL would leave behind, removed by a watchdog.

The agents and SeaweedFS servers run in sessions of their own (so one can
be killed exactly), and the memory tier, the tmpfs stores and the stall
scenario's arena live in ``/dev/shm``. A benchmark ended by the
out-of-memory killer runs no ``finally`` and no ``atexit``: it used to leave
gigabytes of ``/dev/shm`` and processes holding them. So ``watch`` marks
every process the benchmark starts (an environment variable they inherit)
and starts a small process that waits for the benchmark's end, then kills
the marked processes still running and removes ``/dev/shm/<work name>*``
and, unless kept, the work directory. After a normal end these are gone
already, and it finds nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK = "TIERCKPT_BENCH_WORK"
SHM = Path("/dev/shm")


def watch(work: Path, *, keep: bool) -> subprocess.Popen[bytes]:
    """Mark this process's future children with ``work`` and start the watchdog."""
    os.environ[MARK] = str(work)
    command = [sys.executable, "-m", "benchmarks.leftovers", str(os.getpid()), str(work)]
    if keep:
        command.append("--keep")
    # Its own session: a Ctrl-C or a SIGKILL of the benchmark's group must not take it along.
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={key: value for key, value in os.environ.items() if key != MARK},
        cwd=Path(__file__).resolve().parents[1],
    )


def shm_paths(work: Path) -> list[Path]:
    """This run's entries in /dev/shm: each is named after the work directory."""
    return sorted(SHM.glob(f"{work.name}*")) if SHM.is_dir() else []


def marked(work: Path) -> list[int]:
    """Pids of running processes started by the benchmark of ``work``."""
    wanted = f"{MARK}={work}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


# How long the marked processes get to exit on their own once the benchmark
# has: multiprocessing's resource tracker (started with a spawned process)
# exits when its pipe to the benchmark closes, an agent's worker process
# when its agent is gone. Not leftovers: not killed, not reported.
GRACE_SECONDS = 2.0


def clean(work: Path, *, keep: bool, grace: float = GRACE_SECONDS) -> list[str]:
    """Kill the marked processes still running after ``grace`` seconds,
    remove the /dev/shm entries (and the work directory)."""
    done = []
    deadline = time.monotonic() + grace
    while marked(work) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Again until none is found: a process may start one while it is killed
    # (an agent its worker), and one just started shows no environment yet.
    for _ in range(5):
        found = marked(work)
        if not found:
            break
        for pid in found:
            command = _command(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                done.append(f"killed {pid} ({command})")
        time.sleep(0.2)
    for path in shm_paths(work) + ([] if keep else [work]):
        if path.exists():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            done.append(f"removed {path}")
    return done


def _command(pid: int) -> str:
    """``pid``'s command line, as the report names what it killed."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)[:200]


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (old kernel): poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(1)
    try:
        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    owner, work, keep = int(argv[0]), Path(argv[1]), "--keep" in argv[2:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the benchmark
    _wait_for_exit(owner)
    done = clean(work, keep=keep)
    if done:
        print(
            f"bench watchdog: the benchmark (pid {owner}) ended without cleaning up:",
            *done,
            sep="\n  ",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
