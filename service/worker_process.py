"""The job worker and the periodic passes in a child process of the agent.

Why: in one process, the worker's Python (request signing and parsing in
botocore, the upload pipeline per part, the catalog statements of every job)
keeps the agent's event loop and GIL busy most of the time under upload load
(py-spy: the loop was idle 18 % of the time), and a registration or a
`latest` waits behind it: p99 30-110 ms against 3-10 ms with the worker off.
In a child, the worker has a loop and a GIL of its own; the agent's loop
serves requests and runs the registration writer. The child runs niced
(``[worker] process_nice``): on a node's few busy cores the agent's requests
get a CPU first.

Parent side, ``WorkerChild``: plays the in-process worker's part for the agent
(agent.py): ``start`` returns the task the agent supervises (it ends, with an
error, when the child exits unasked: ``/healthz`` then answers 503 naming the
worker), ``wake``, ``begin_drain``, ``stop(grace)``, ``alive``, ``busy``.

Between the two, one Unix socket pair, newline-delimited JSON:

* parent -> child: the settings (first line), then ``wake`` (work was just
  enqueued: a registration), ``drain`` (SIGTERM: only this node's work
  from now on), ``stop`` with the grace its running jobs get;
* child -> parent: its state about once a second: jobs running and its
  counters and histograms (``metrics.worker_samples``), which ``/metrics``
  adds to the agent's own (``metrics.generate_with``).

The child never outlives the agent: the kernel kills it when the agent dies
(``PR_SET_PDEATHSIG``, also after a kill -9), and it stops when the socket
closes. It ignores SIGINT and SIGTERM: a Ctrl-C or a signal sent to the whole
process group reaches the agent, which drains and then stops the child. The
jobs it held when killed are given back as after any kill -9 of an agent:
the next start on the node releases them, or their leases expire.

On SQLite the two processes write one file: the in-process write gate no
longer orders the child's transactions behind the registrations, so the
registration writer waits for the write lock on its own terms
(``db.create_sync_engine(..., eager_lock=True)``) and raises a flag in
shared memory meanwhile, which the child's transactions yield to before
they begin (write_gate.UrgentFlag); the child's transactions hold the lock
for their statements only (sqlite_driver.py: inline, the fsync after).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from . import cpu_affinity, lock_holder
from .config import Settings
from .write_gate import share_urgent_flag, urgent_flag_raised_by_agent

log = logging.getLogger("tierckpt.worker_process")

# How often the child reports its state (busy jobs, metrics) when it changed.
REPORT_SECONDS = 1.0
# After ``stop``: seconds beyond the grace the child gets to give its jobs
# back and close, before it is killed.
STOP_MARGIN = 15.0
_PR_SET_PDEATHSIG = 1


class WorkerChild:
    """The agent's handle on its worker process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.node = settings.server.node
        self.busy = 0
        # The child's latest report of its metrics (metrics.worker_samples).
        self.samples: list[Any] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Bytes not yet taken by the socket (sent by _flush when it can write).
        self._out = bytearray()

    def start(self) -> asyncio.Task[None]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # SQLite: the registrations' precedence over the child's transactions.
        flag = share_urgent_flag()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    str(theirs.fileno()),
                    str(os.getpid()),
                    str(flag.fd),
                ],
                pass_fds=(theirs.fileno(), flag.fd),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._sock = ours
        ours.setblocking(False)
        self._out += self.settings.model_dump_json().encode() + b"\n"
        self._flush()
        self._task = asyncio.create_task(self._run(), name="tierckpt-worker-process")
        return self._task

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wake(self) -> None:
        """Work was just enqueued: the child's worker looks now. A wake-up that
        does not fit in the socket's buffer is dropped: the child has not read
        the ones before it yet, and reads them all at once."""
        self._send({"op": "wake"})

    def begin_drain(self) -> None:
        self._send({"op": "drain"})

    async def stop(self, grace: float | None = None) -> None:
        """The child's worker stops claiming; running jobs get ``grace``
        seconds (default ``shutdown_timeout``), then are given back."""
        self._stopping = True
        if grace is None:
            grace = self.settings.worker.shutdown_timeout
        self._send({"op": "stop", "grace": grace})
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), grace + STOP_MARGIN)
            except TimeoutError:
                log.warning("the worker process did not stop in time: killed")
            except Exception:  # the child's end was logged by the agent already
                pass
        self._kill()

    def _send(self, message: dict[str, Any]) -> None:
        if self._sock is None:
            return
        pending = bool(self._out)
        self._out += json.dumps(message).encode() + b"\n"
        if not pending:
            self._flush()

    def _flush(self) -> None:
        """Send what the socket takes now; the rest when it can write again
        (never blocking the agent's loop, never splitting a line for good)."""
        sock = self._sock
        if sock is None:
            self._out.clear()
            return
        loop = asyncio.get_running_loop()
        try:
            sent = sock.send(self._out)
        except BlockingIOError:
            sent = 0
        except OSError:  # the child is gone: its task says so
            self._out.clear()
            sent = 0
        del self._out[:sent]
        loop.remove_writer(sock.fileno())
        if self._out:
            loop.add_writer(sock.fileno(), self._flush)

    async def _run(self) -> None:
        """Read the child's reports until it exits; an exit not asked for is an error."""
        assert self._sock is not None and self._proc is not None
        loop = asyncio.get_running_loop()
        buffered = b""
        try:
            while True:
                try:
                    data = await loop.sock_recv(self._sock, 65536)
                except ConnectionError:  # it died with our lines unread
                    data = b""
                if not data:
                    break
                buffered += data
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    report = json.loads(line)
                    self.busy = int(report.get("busy", 0))
                    self.samples = report.get("metrics", self.samples)
        finally:
            loop.remove_writer(self._sock.fileno())
            self._sock.close()
            self._sock = None
        code = await asyncio.to_thread(self._proc.wait)
        self.busy = 0
        if not self._stopping:
            raise RuntimeError(f"the worker process exited with status {code}")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


# -- the child ---------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the agent dies, however it dies (Linux); and if it died
    before this was set up, exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the closed socket stops the child
        pass
    if os.getppid() != parent:
        os._exit(0)


class _Child:
    def __init__(self, sock: socket.socket, settings: Settings, received: bytes) -> None:
        self.sock = sock
        self.received = received  # commands that came with the settings
        self.settings = settings
        self.stopped = asyncio.Event()
        self.grace: float | None = None

    async def run(self) -> int:
        from .background import background
        from .resources import close_resources, open_resources

        # The regions were checked by the agent: one that is down now must
        # not hold up the worker's start (its jobs retry).
        resources = await open_resources(self.settings, check_regions=False)
        if self.settings.memory.bytes > 0:
            from .memory.reader import ArenaReader
            from .memory.service import arena_directory

            # Uploads of checkpoints staged in the agent's memory tier read
            # them from there while the agent writes T0 (memory/reader.py).
            resources.open_in_memory = ArenaReader(arena_directory(self.settings)).open_file
        status = 0
        try:
            worker, passes = background(resources)
            # As the agent does (app.py): what lives as long as the process
            # is out of the collector's sight from now on.
            gc.freeze()
            tasks = {"worker": worker.start()}
            tasks.update({f"{p.name} pass": p.start() for p in passes})
            commands = asyncio.create_task(self._commands(worker))
            reports = asyncio.create_task(self._reports(worker))
            stopped = asyncio.create_task(self.stopped.wait())
            done, _ = await asyncio.wait(
                [stopped, *tasks.values()], return_when=asyncio.FIRST_COMPLETED
            )
            for name, task in tasks.items():
                if task in done:  # it never should end: the agent must see it
                    log.error(
                        "agent component %s ended in the worker process",
                        name,
                        exc_info=task.exception() if not task.cancelled() else None,
                    )
                    status = 1
            for p in passes:
                await p.stop()
            await worker.stop(self.grace)
            helpers: list[asyncio.Task[Any]] = [commands, reports, stopped]
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(commands, reports, stopped, return_exceptions=True)
            await self._report(worker)  # the last counts
        finally:
            await close_resources(resources)
        return status

    async def _commands(self, worker: Any) -> None:
        loop = asyncio.get_running_loop()
        buffered = b""
        data = self.received
        while True:
            if not data:
                try:
                    data = await loop.sock_recv(self.sock, 65536)
                except ConnectionError:
                    data = b""
            if not data:  # the agent is gone: give the jobs back now
                self.grace = 0.0
                self.stopped.set()
                return
            buffered += data
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                command = json.loads(line)
                op = command.get("op")
                if op == "wake":
                    worker.wake()
                elif op == "drain":
                    worker.begin_drain()
                elif op == "stop":
                    self.grace = float(command.get("grace", 0.0))
                    self.stopped.set()
            data = b""

    async def _reports(self, worker: Any) -> None:
        last: Any = None
        while True:
            await asyncio.sleep(REPORT_SECONDS)
            last = await self._report(worker, unless=last)

    async def _report(self, worker: Any, unless: Any = None) -> Any:
        from .observability import metrics

        state = {"busy": worker.busy, "metrics": metrics.worker_samples()}
        if state != unless:
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_sendall(self.sock, json.dumps(state).encode() + b"\n")
            except OSError:
                pass  # the agent is gone; _commands sees the socket closed
        return state


def main(argv: list[str]) -> int:
    fd, parent, flag = int(argv[0]), int(argv[1]), int(argv[2])
    _die_with_parent(parent)
    urgent_flag_raised_by_agent(flag)
    # The agent drains and then stops this process; a signal to the group
    # (Ctrl-C, a scheduler) must not end it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    first = b""
    while not first.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return 0
        first += chunk
    line, _, rest = first.partition(b"\n")
    settings = Settings.model_validate_json(line)

    from .allocator import return_large_buffers_to_os
    from .observability.logs import configure_logging

    return_large_buffers_to_os()
    configure_logging(settings.server.log_format)
    if settings.worker.process_nice:
        agent_nice = os.nice(0)
        worker_nice = os.nice(settings.worker.process_nice)
        lock_holder.inherit_priority(agent_nice, worker_nice)
    cpu_affinity.confine_process(settings.worker.cpu_set, "the worker process")
    sock.setblocking(False)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    return int(runner(_Child(sock, settings, rest).run()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
