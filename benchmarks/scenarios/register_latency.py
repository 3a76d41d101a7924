"""Register latency: the trainer's stall, idle and while the agent works.

Two measurements.

**Under upload load** (the condition trainers see): an agent with its worker
on, two regions (two buckets of one SeaweedFS server, so the second is filled
by replicate jobs), retention and the scrubber on short intervals. A load
process keeps ``IN_FLIGHT`` checkpoints of ``LOAD_BYTES`` each registered and
not yet durable, so uploads, commits, replication, verification and retention
run the whole time. Meanwhile the timed client registers a tiny checkpoint
(one 4 KiB file), then asks for ``latest`` of its run, sequentially; then
it polls ``latest`` alone every 10 ms, as an orchestrator does (that
``latest`` does not come at the moment its own registration's write and the
worker's claim of it run). The tiny checkpoints are uploaded too. The
SeaweedFS server of this measurement keeps its data on a tmpfs (/dev/shm
when it exists): the store must not share the agent's disk, or the figure
would be the store's writes competing with the catalog's fsyncs, not the
agent's own work. The same agent with its
worker off (nothing uploads) gives the idle figure beside it, and the same
load with the worker in its own process (``[worker] separate_process =
"yes"``, the default with PostgreSQL) and in the agent's (``"no"``, the
default with SQLite), side by side. Both on SQLite and on PostgreSQL. The machine's own floor is
measured during each loaded round too: an fsync of 4 KiB on the catalog's
disk (every registration's commit is flushed by one, after its answer by
default on SQLite: ``[catalog] register_ack = "recorded"``) and how late a 1 ms sleep wakes up
(the wait for a CPU). Each timed register + `latest` is followed by one call to a do-nothing
server (empty_server.py) with the same HTTP stack: the floor any call meets
on this machine at that moment, beside the figures it bounds.
Client-observed times, and the agent's own time for the
same requests (each answer's ``Server-Timing`` header: from the request's
arrival in the agent's application to the answer's headers); the phases of
a registration come from the agent's request log.

Each round also times the trainer's default path under the same load: a
segment of the agent's memory tier reserved, written and registered
(``TorchCheckpointer(staging="memory")``). That register is recorded in the
segment and reaches the catalog after the agent has written T0, so it waits
on neither the catalog's lock nor its fsync; the register above (files
already on T0, ``staging="disk"``, orchestrators) is answered once recorded
in the agent's inbox after one lock-free read of the catalog (``register_ack
= "recorded"``, the default on SQLite), its catalog write following behind the
answer, or at its commit (``"committed"``, the default on PostgreSQL); each
catalog is also measured the other way, under the same load.

The back-to-back streams leave the worker far more than it can do: each
round registers about 600 tiny checkpoints as fast as the client can, and
each costs the agent 130-145 ms of CPU from register to deletion
(`worker_cost`), so the worker's backlog (queued + running jobs, recorded
at each round's start and end) grows by hundreds of jobs a round: a stress
form, in which the registrations meet the worker's whole backlog. The paced
streams meet the load's own work instead: on an agent of their own with the
same load, the same two paths, one call every ``PACE_SECONDS``, a rate the
worker keeps up with. Every mode runs the agent's default, the background
confined (``[worker] cpus = "auto"``: the highest quarter of the CPUs, on
two the last), the rest left to the agent's requests, the trainers and the
catalog; the paced streams run once more with the background on every CPU
(``cpus = "all"``), labelled apart, the default's p99s and uploads' pace
as ratios to that one's. In every loaded mode the store's
threads run on that last quarter of the CPUs: it stands for a store on
other machines, which takes none of the node's CPU; there it slows the
uploads (which a remote store would not), not the calls.

**Idle, by size**: 1 MB against a sparse 10 GiB file, on an agent whose
worker is off. Register only lists the files (size, mtime) and writes
catalog rows; it never reads content, so its latency must not depend on the
checkpoint's size.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from devsupport import postgres as pg
from devsupport.seaweed import SeaweedServer
from tierckpt.client import CheckpointClient
from tierckpt.client._api import USER_AGENT
from tierckpt.client._files import fsync_file
from tierckpt.service.cpu_affinity import allowed_cpus, background_share, format_list

from ..context import Agent, BenchContext, log, s3_region
from ..data import MiB, sparse_file, write_random
from ..empty_server import empty_server
from ..procstat import confine, cpu_ticks, meminfo_bytes, steal_share
from ..stats import percentile, ratios, row
from ..tmpfs_store import size_bytes, tmpfs_seaweed, vacuum
from ..worker_queue import busy_jobs

# The floor rows' call: what any HTTP call costs on this machine at that
# moment, before an agent does any work (empty_server.py).
FLOOR_CALL = "an empty answer (a do-nothing ASGI server, the same server and client stacks)"
# The agent's phases of a registration, as its request log names them.
PHASES = ("scan", "record", "queued", "gate", "lock", "write", "commit", "sync")

NAME = "register_latency"
TITLE = "Register latency (trainer stall, ms; lower is better)"
REQUIRES: tuple[str, ...] = ()

LARGE_BYTES = 10 * 1024 * MiB
SMALL_BYTES = 1 * MiB
TINY_BYTES = 4096
WARMUP = 5
# Load: checkpoints kept registered and not yet durable, and their size.
IN_FLIGHT = 3
LOAD_FILES = 4
LOAD_FILE_BYTES = 8 * MiB
TARGET_P99_MS = 10.0
# An orchestrator's poll of `latest`, apart from the register stream.
POLL_SECONDS = 0.01
# The paced streams: a registration every PACE_SECONDS (4 a second: a node's
# trainers register a few checkpoints a second at most), on an agent of
# their own, so that the background work they meet is the load's. Each
# tiny checkpoint costs the agent about 130-145 ms of CPU from register to
# deletion with this configuration (`worker_cost`): the worker keeps up with
# 4 a second on one core, not with 20 (the pace here before, which met a
# backlog of thousands of jobs left by the back-to-back streams).
PACE_SECONDS = 0.25
# The CPUs `[worker] cpus = "auto"` gives the background work on this
# machine, where the store's threads run in every mode; none on one CPU.
BACKGROUND_CPUS = background_share(allowed_cpus())
# idle: worker off; load: the worker in its own process (worker_process.py);
# load-other: the same load, registrations answered the other way ([catalog]
# register_ack: "committed" on SQLite, "recorded" on PostgreSQL, where "auto",
# the default, picks the other); paced: the same load on an agent of its own,
# the timed calls paced (every mode but paced-all with the default `[worker]
# cpus = "auto"`: the background on BACKGROUND_CPUS); paced-all: the same with
# `cpus = "all"`, the background on every CPU. (The worker in the agent's
# process, compared here before, is in the README.)
MODES = ("idle", "load", "load-other", "paced", "paced-all")
PACED_MODES = ("paced", "paced-all")
OTHER_ACK = {"SQLite": "committed", "PostgreSQL": "recorded"}


def run(ctx: BenchContext) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    details: dict[str, Any] = {}
    loaded_rows, loaded_notes, details["under_load"] = _under_load(ctx)
    rows += loaded_rows
    notes += loaded_notes
    size_rows, size_notes, details["by_size"] = _by_size(ctx)
    rows += size_rows
    notes += size_notes
    return {"rows": rows, "notes": notes, "details": details}


# -- under upload load ----------------------------------------------------------


def _loaded_agent(
    ctx: BenchContext,
    name: str,
    store: SeaweedServer,
    catalog: str | None,
    *,
    worker: bool,
    register_ack: str = "auto",
    worker_cpus: str | None = None,
) -> Agent:
    east = s3_region("east", store)
    west = {**s3_region("west", store), "bucket": "bench-west"}
    sections: dict[str, dict[str, Any]] = {
        "server": {
            "node": f"{name}-node",
            "rate_limit_per_second": 1_000_000,
            "rate_limit_burst": 1_000_000,
            "log_format": "json",  # the agent's own request times are read from it
        },
        # Retention deletes older load checkpoints (delete jobs in both
        # regions, T0 eviction); the scrubber verifies committed copies.
        "retention": {"keep_last": 4, "interval_seconds": 2.0},
        "scrub": {"interval_seconds": 2.0, "min_age_hours": 0.0},
        "local": {"keep_last": 2},
    }
    sections["catalog"] = {"register_ack": register_ack}
    if catalog is not None:
        sections["catalog"]["url"] = catalog
    return ctx.start_agent(
        name,
        worker=worker,
        regions=[east, west],
        # The worker in its own process: the default; its CPUs the default's
        # unless ``worker_cpus`` says otherwise.
        worker_settings={
            "separate_process": "yes",
            **({"cpus": worker_cpus} if worker_cpus is not None else {}),
        },
        **sections,
    )


class _Load:
    """A process keeping ``IN_FLIGHT`` load checkpoints registered and not yet
    durable. A process of its own, as the other trainers it stands for: in a
    thread of the benchmark's process its HTTP and JSON work would hold the
    GIL the timed client needs, and the figure would include that wait."""

    def __init__(self, url: str, base: Path, run_name: str) -> None:
        self.url, self.base, self.run_name = url, base, run_name
        self.source = base / "source"
        for n in range(LOAD_FILES):
            write_random(self.source / f"part-{n}.bin", LOAD_FILE_BYTES)
            # On disk before the measurement: their writeback would otherwise
            # land in the first round, a start-up transient (the load's later
            # checkpoints are hard links of these, they write no data).
            fsync_file(self.source / f"part-{n}.bin")
        self.registered = 0
        self.durable = 0
        self.errors: list[str] = []
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._hold = context.Event()
        self._durable = context.Value("i", 0)
        self._in_flight = context.Value("i", 0)
        self._totals = base / "totals.json"
        self._process = context.Process(
            target=_load_loop,
            args=(
                url,
                str(base),
                run_name,
                self._stop,
                self._hold,
                self._durable,
                self._in_flight,
                str(self._totals),
            ),
            name="bench-load",
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()

    def wait_steady(self, at_least: float = 3.0, at_most: float = 60.0) -> None:
        """Until the first load checkpoint is durable: the load's start (its
        process's imports, the first uploads all at once) is not the
        condition measured; then uploads, commits and replication run."""
        began = time.monotonic()
        while time.monotonic() - began < at_most:
            if self._durable.value >= 1 and time.monotonic() - began >= at_least:
                return
            time.sleep(0.1)

    def durable_now(self) -> int:
        """The load's checkpoints made durable so far."""
        return int(self._durable.value)

    def hold(self, at_most: float = 120.0) -> None:
        """No new load checkpoints, until those in flight are durable (the
        store then takes no more writes from it)."""
        self._hold.set()
        began = time.monotonic()
        while self._in_flight.value and time.monotonic() - began < at_most:
            time.sleep(0.1)

    def go_on(self) -> None:
        """New load checkpoints again, until the first of them is durable."""
        durable = self._durable.value
        self._hold.clear()
        began = time.monotonic()
        while self._durable.value <= durable and time.monotonic() - began < 60.0:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._process.join(60)
        if self._process.is_alive():
            self._process.kill()
            self.errors.append("the load process did not stop; killed")
            return
        try:
            totals = json.loads(self._totals.read_text())
        except (OSError, ValueError) as exc:
            self.errors.append(f"no totals from the load process: {exc}")
            return
        self.registered, self.durable = totals["registered"], totals["durable"]
        self.errors += totals["errors"]


def _load_loop(
    url: str,
    base: str,
    run_name: str,
    stop: Any,
    hold: Any,
    durable_count: Any,
    in_flight: Any,
    totals_path: str,
) -> None:
    """The load process: register, follow until durable, register again
    (unless held)."""
    source = Path(base) / "source"
    registered = durable = 0
    errors: list[str] = []

    def copy(step: int) -> Path:
        target = Path(base) / f"step-{step}"
        target.mkdir(parents=True, exist_ok=True)
        for part in source.iterdir():
            os.link(part, target / part.name)
        return target

    pending: list[int] = []
    step = 0
    with CheckpointClient(url) as client:
        while not stop.is_set():
            try:
                still: list[int] = []
                for s in pending:
                    state = client.get(run_name, s).state
                    if state in ("durable", "replicated", "deleted"):
                        durable += 1
                        durable_count.value = durable
                    elif state == "failed":
                        errors.append(f"{run_name}:{s} failed")
                    else:
                        still.append(s)
                pending = still
                while len(pending) < IN_FLIGHT and not hold.is_set():
                    step += 1
                    client.register(run_name, step, copy(step))
                    registered += 1
                    pending.append(step)
                in_flight.value = len(pending)
            except Exception as exc:  # reported, the measurement goes on
                errors.append(f"{type(exc).__name__}: {exc}")
            stop.wait(0.1)
    Path(totals_path).write_text(
        json.dumps({"registered": registered, "durable": durable, "errors": errors[:10]})
    )


class _Floor:
    """The machine's floor while the load runs, probed in a thread of this
    process: fdatasync of a 4 KiB write on the catalog's disk, and the
    oversleep of a 1 ms sleep (time waiting for a CPU)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "fsync-probe"
        self.fsync: list[float] = []
        self.wake: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-floor", daemon=True)

    def __enter__(self) -> _Floor:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.path.unlink(missing_ok=True)

    def _loop(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            block = b"\0" * 4096
            while not self._stop.wait(0.05):
                os.pwrite(fd, block, 0)
                began = time.perf_counter()
                os.fdatasync(fd)
                self.fsync.append((time.perf_counter() - began) * 1000)
                began = time.perf_counter()
                time.sleep(0.001)
                self.wake.append((time.perf_counter() - began) * 1000 - 1.0)
        finally:
            os.close(fd)


class _ClientCollections:
    """Python's cyclic collections in this process (the timed client's, as a
    trainer's would be) while the timed streams run, each one's milliseconds.
    A collection stops the thread that triggers it, inside whichever call
    allocates at that moment; what the client leaves in reference cycles
    (client/_responses.py) is what brings them about."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._began = 0.0

    def __enter__(self) -> _ClientCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.ms.append((time.perf_counter() - self._began) * 1000)


def _logged(log_path: Path, request_id: str) -> Iterator[dict[str, Any]]:
    """The agent's request-log entries (JSON lines) of the requests sent with
    ``request_id``, in order."""
    for line in log_path.read_text(errors="replace").splitlines():
        if request_id not in line or "duration_ms" not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("request_id") == request_id:
            yield entry


def _phases(log_path: Path, request_id: str) -> dict[str, list[float]]:
    """Where the agent's time went in each register sent with
    ``request_id`` (service/checkpoints/register_timing.py), from its request
    log, in order: ``phase_<name>`` lists."""
    out: dict[str, list[float]] = {}
    for entry in _logged(log_path, request_id):
        if entry.get("method") == "POST" and entry.get("path") == "/v1/checkpoints":
            for phase in PHASES:
                out.setdefault(f"phase_{phase}", []).append(
                    float(entry.get(f"register_{phase}_ms", 0.0))
                )
    return out


class _AgentTimes:
    """The agent's own time of each answer a client gets (its ``Server-Timing``
    header: from the request's arrival to the answer's headers), by kind of
    request, in order. Every request, where the agent's log leaves quiet
    GETs (``latest``) out."""

    KINDS = (
        ("POST", re.compile(r"^/v1/checkpoints$"), "server_register"),
        ("GET", re.compile(r"^/v1/runs/[^/]+/latest$"), "server_latest"),
        ("POST", re.compile(r"^/v1/memory/segments$"), "server_reserve"),
        ("POST", re.compile(r"^/v1/memory/segments/[^/]+/register$"), "server_stage"),
    )

    def __init__(self, client: CheckpointClient) -> None:
        self.times: dict[str, list[float]] = {}
        client._http.event_hooks["response"].append(self._record)

    def _record(self, response: httpx.Response) -> None:
        timing = response.headers.get("server-timing", "")
        if not timing.startswith("app;dur="):
            return
        request = response.request
        for method, path, kind in self.KINDS:
            if request.method == method and path.match(request.url.path):
                self.times.setdefault(kind, []).append(float(timing.removeprefix("app;dur=")))

    def after_warmup(self) -> dict[str, list[float]]:
        return {kind: values[WARMUP:] for kind, values in self.times.items()}


class _Pace:
    """Waits between the calls of a paced stream (``seconds`` apart, start to
    start; ``None``: back to back)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._next = time.perf_counter()

    def wait(self) -> None:
        if self.seconds is None:
            return
        self._next += self.seconds
        delay = self._next - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:  # late (a slow call): the next call starts now, no catching up
            self._next = time.perf_counter()


class _FloorCalls:
    """Calls to the empty server (empty_server.py) from this process, with the
    client's own HTTP stack: an ``httpx.Client`` as CheckpointClient makes
    it, a POST with a JSON body of a registration's size."""

    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=30, headers={"User-Agent": USER_AGENT})

    def __enter__(self) -> _FloorCalls:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._http.close()

    def call(self, run_name: str, step: int, path: Path) -> float:
        """One call's milliseconds."""
        body = {"run": run_name, "step": step, "path": str(path), "files": None}
        began = time.perf_counter()
        self._http.post("/v1/checkpoints", json=body).raise_for_status()
        return (time.perf_counter() - began) * 1000


def _timed(
    agent: Agent,
    base: Path,
    run_name: str,
    count: int,
    floor_url: str,
    pace: float | None = None,
) -> dict[str, list[float]]:
    """Sequential register + `latest` (``pace`` apart, or back to back), each
    pair followed by one call to ``floor_url`` (an empty server:
    empty_server.py) with the same HTTP client stack, the machine's floor for
    a call at that moment (``empty``)."""
    source = base / "tiny.bin"
    write_random(source, TINY_BYTES)
    samples: dict[str, list[float]] = {"register": [], "latest": [], "empty": []}
    request_id = f"bench-timed-{run_name}"
    pacer = _Pace(pace)
    floor = _FloorCalls(floor_url)
    with CheckpointClient(agent.url) as client, floor:
        # Tags the timed requests in the agent's request log (the load's are not).
        client._http.headers["x-request-id"] = request_id
        own = _AgentTimes(client)
        for step in range(1, WARMUP + count + 1):
            pacer.wait()
            # A directory per step: T0 eviction removes older steps' files.
            tiny = base / f"step-{step}"
            tiny.mkdir(parents=True)
            os.link(source, tiny / "model.bin")
            began = time.perf_counter()
            answer = client.register(run_name, step, tiny)
            registered = time.perf_counter()
            client.latest(run_name)
            ended = time.perf_counter()
            empty = floor.call(run_name, step, tiny)
            if answer.state != "registered":
                raise RuntimeError(f"register {run_name}:{step} answered {answer.state}")
            if step > WARMUP:
                samples["register"].append((registered - began) * 1000)
                samples["latest"].append((ended - registered) * 1000)
                samples["empty"].append(empty)
    samples.update(own.after_warmup())
    for phase, values in _phases(agent.log_path, request_id).items():
        samples[phase] = values[WARMUP:]
    return samples


FIGURES: dict[str, Callable[[list[float]], float]] = {
    "p50": lambda values: percentile(values, 50),
    "p99": lambda values: percentile(values, 99),
    "max": max,
}


def _timed_rows(
    label: str,
    rounds: list[dict[str, list[float]]],
    client: str,
    server: str | None,
    *,
    target: bool,
) -> list[dict[str, Any]]:
    """p50, p99 and max of the ``client`` times over the rounds, with the
    median round's figure of the agent's own (``server``) in the note and the
    target beside the p99 when ``target``."""
    out = []
    for metric, figure in FIGURES.items():
        values = [figure(s[client]) for s in rounds]
        server_values = [figure(s[server]) for s in rounds if server and s.get(server)]
        notes = [f"target ≤ {TARGET_P99_MS:.0f} ms"] if target and metric == "p99" else []
        if server_values:
            notes.append(f"agent's own: {percentile(server_values, 50):.1f} ms")
        out.append(row(label, metric, "ms", values, note="; ".join(notes)))
    return out


def _floor_rows(
    catalog_name: str,
    per_mode: dict[str, list[dict[str, list[float]]]],
    modes: tuple[str, ...],
    labels: dict[str, str],
    *,
    paced: bool = False,
) -> list[dict[str, Any]]:
    """The empty server's answers in ``modes``' register streams
    (``_FloorCalls``): the machine's floor beside the register rows."""
    stream, key = (", paced", "paced_empty") if paced else ("", "empty")
    rows: list[dict[str, Any]] = []
    for mode in modes:
        rows += _timed_rows(
            f"{catalog_name} machine floor: {FLOOR_CALL}, after each register + latest"
            f"{stream}, {labels[mode]}",
            per_mode[mode],
            key,
            None,
            target=False,
        )
    return rows


def _timed_polls(agent: Agent, run_name: str, count: int) -> dict[str, list[float]]:
    """``latest`` as an orchestrator asks it: polled every ``POLL_SECONDS``
    under the same load, not right after a registration of the caller's own
    (the register stream above asks it at the moment its registration's
    write and the worker's claim of it run)."""
    samples: list[float] = []
    with CheckpointClient(agent.url) as client:
        own = _AgentTimes(client)
        for n in range(WARMUP + count):
            time.sleep(POLL_SECONDS)
            began = time.perf_counter()
            client.latest(run_name)
            if n >= WARMUP:
                samples.append((time.perf_counter() - began) * 1000)
    return {"latest_polled": samples, "server_latest_polled": own.after_warmup()["server_latest"]}


def _timed_staged(
    agent: Agent, base: Path, run_name: str, count: int, pace: float | None = None
) -> dict[str, list[float]]:
    """The trainer's default path (``TorchCheckpointer(staging="memory")``):
    write the tiny file into a segment of the agent's memory tier, register
    the segment, then ask for ``latest``, sequentially. As the checkpointer
    does, each registration asks for the next save's segment
    (``reserve_next``), so only the first save (or one the agent found no
    room ahead for) makes a reservation call of its own; the stall is
    reservation (if any) + write + register. The registration of a segment
    is recorded in the segment; the catalog gets it once the agent has
    written it to T0 (service/memory/persist.py), so these checkpoints add
    their persisting to the load."""
    payload = os.urandom(TINY_BYTES)
    samples: dict[str, list[float]] = {"reserve": [], "stage": [], "stall": []}
    pacer = _Pace(pace)
    ahead = None
    with CheckpointClient(agent.url) as client:
        own = _AgentTimes(client)
        for step in range(1, WARMUP + count + 1):
            pacer.wait()
            began = time.perf_counter()
            segment = ahead or client.reserve_segment(run_name, step, {"model.bin": TINY_BYTES})
            reserved = time.perf_counter()
            with open(Path(segment.path) / "model.bin", "wb") as out:
                out.write(payload)
            written = time.perf_counter()
            answer = client.register_segment(
                segment.id, run_name, step, base / f"step-{step}", reserve_next=True
            )
            staged = time.perf_counter()
            ahead = answer.next_segment
            client.latest(run_name)
            if answer.state != "staged":
                raise RuntimeError(f"segment of {run_name}:{step} answered {answer.state}")
            if step > WARMUP:
                samples["reserve"].append((reserved - began) * 1000)
                samples["stage"].append((staged - written) * 1000)
                samples["stall"].append((staged - began) * 1000)
    times = own.after_warmup()
    for kind in ("server_reserve", "server_stage"):
        samples[kind] = times.get(kind, [])
    return samples


def _lock_holder_priority() -> str:
    """Whether this machine lets the worker's lock holder take the agent's
    niceness back (service/lock_holder.py): it needs CAP_SYS_NICE."""
    seen: list[bool] = []

    def probe() -> None:
        me = threading.get_native_id()
        own = os.getpriority(os.PRIO_PROCESS, me)
        try:
            os.setpriority(os.PRIO_PROCESS, me, min(own + 1, 19))
            os.setpriority(os.PRIO_PROCESS, me, own)
            seen.append(own < 19)
        except OSError:
            seen.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    if seen and seen[0]:
        return "permitted here: CAP_SYS_NICE; without it the holder stays niced"
    return "not permitted here: no CAP_SYS_NICE, the holder stays niced"


def _catalogs() -> list[str]:
    """SQLite always; PostgreSQL when a server is reachable (devsupport.postgres)."""
    return ["SQLite", "PostgreSQL"] if pg.postgres_available() else ["SQLite"]


def _round(
    agent: Agent, work: Path, base: Path, rep: int, count: int, mode: str, floor_url: str
) -> dict[str, list[float]]:
    """One round of the back-to-back streams: register + `latest` (each pair
    followed by a call to the empty server), the polls, and (with the worker
    on) memory-segment saves; the machine's floor meanwhile."""
    with _Floor(work / base.name) as floor, _ClientCollections() as gcs:
        samples = _timed(agent, base / f"rep{rep}", f"bench-tiny-{rep}", count, floor_url)
        samples.update(_timed_polls(agent, f"bench-tiny-{rep}", count))
        # The memory tier needs the worker (it persists the segments): not
        # in the idle mode.
        if mode != "idle":
            staged = _timed_staged(agent, base / f"staged{rep}", f"bench-staged-{rep}", count)
            samples.update({f"segment_{k}": v for k, v in staged.items()})
    samples["fsync"], samples["wake"] = floor.fsync, floor.wake
    samples["client_gc"] = gcs.ms
    return samples


def _paced_round(
    agent: Agent, base: Path, rep: int, count: int, floor_url: str
) -> dict[str, list[float]]:
    """One round of the paced streams: register + `latest` of files on T0
    (each pair followed by a call to the empty server), then memory-segment
    saves, one every PACE_SECONDS."""
    paced = _timed(
        agent, base / f"paced{rep}", f"bench-paced-{rep}", count, floor_url, PACE_SECONDS
    )
    staged = _timed_staged(
        agent, base / f"paced-staged{rep}", f"bench-paced-staged-{rep}", count, PACE_SECONDS
    )
    return {
        **{f"paced_{k}": v for k, v in paced.items()},
        **{f"paced_segment_{k}": v for k, v in staged.items()},
    }


def _confined_ratio(
    what: str, metric: str, ratio: float, note: str = "below 1: confining helps"
) -> dict[str, Any]:
    """A row of the paced mode's figure (the default, `cpus = "auto"`) over the
    paced-all one's (`cpus = "all"`)."""
    label = f'{what}, the default cpus = "auto" against cpus = "all"'
    return row(label, metric, "×", [ratio], note=note)


def _compact(store: SeaweedServer) -> None:
    """The garbage of the load's deleted checkpoints compacted away: on a
    tmpfs it is the node's memory, where a remote store's is not. After each
    mode (its agent stopped), and between the rounds of the paced modes,
    whose uploads leave about 9 GiB a round; not between the back-to-back
    rounds, whose load leaves about 1 GiB and whose backlog keeps writing:
    a compaction there can outlast its timeout. Logged, never fatal."""
    try:
        log(f"register latency: the store compacted in {vacuum(store, timeout=600.0):.1f} s")
    except httpx.HTTPError as exc:
        log(f"register latency: the store's compaction failed ({exc!r}); rounds go on")


def _round_line(catalog: str, mode: str, rep: int, reps: int, samples: dict[str, Any]) -> str:
    def p99(key: str) -> str:
        return f"{percentile(samples[key], 99):.1f} ms"

    head = f"register latency {catalog} {mode} rep {rep + 1}/{reps}: "
    backlog = (
        "; worker backlog (queued + running jobs) at the round's start / end: "
        f"{samples['backlog_start'][0]:.0f} / {samples['backlog_end'][0]:.0f}; "
        f"CPU steal {samples['steal'][0]:.1f} %; memory available at the start / end "
        f"{samples['memory_start'][0] / 2**30:.1f} / {samples['memory_end'][0] / 2**30:.1f} GiB, "
        f"the store's tmpfs {samples['store_bytes'][0] / 2**30:.1f} GiB; "
        f"load checkpoints durable {samples.get('load_rate', [0.0])[0]:.2f} a second"
    )
    if mode in PACED_MODES:
        return (
            f"{head}register p99 {p99('paced_register')}, latest p99 {p99('paced_latest')}, "
            f"memory segment register p99 {p99('paced_segment_stage')}, empty server's "
            f"answer p99 {p99('paced_empty')}{backlog}"
        )
    line = (
        f"{head}p50 {percentile(samples['register'], 50):.1f} ms, p99 {p99('register')}, "
        f"max {max(samples['register']):.1f} ms; latest p99 {p99('latest')} (polled: "
        f"{p99('latest_polled')}); fsync p99 "
        f"{percentile(samples['fsync'] or [0.0], 99):.1f} ms"
    )
    if samples.get("segment_stage"):
        line += f"; memory segment register p99 {p99('segment_stage')}"
    if samples.get("empty"):
        line += f"; empty server's answer p99 {p99('empty')}"
    return line + backlog


def _under_load(ctx: BenchContext) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    count = 100 if ctx.quick else 300
    paced_count = 30 if ctx.quick else 100
    reps = max(1, min(ctx.reps, 2 if ctx.quick else 3))
    results: dict[str, dict[str, list[dict[str, list[float]]]]] = {}
    load_totals: dict[str, Any] = {}
    with (
        tmpfs_seaweed(ctx.work, ("bench", "bench-west")) as (store, store_dir),
        empty_server() as floor_url,
    ):
        if BACKGROUND_CPUS:  # the store stands for one on other machines
            confine(store.pid, BACKGROUND_CPUS)
        for catalog_name in _catalogs():
            databases: list[str] = []
            try:
                per_mode: dict[str, list[dict[str, list[float]]]] = {m: [] for m in MODES}
                for mode in MODES:
                    url = None
                    if catalog_name == "PostgreSQL":
                        url = pg.create_temp_database(pg.postgres_admin_url())
                        databases.append(url)
                    name = f"lat-{catalog_name.lower()}-{mode}"
                    agent = _loaded_agent(
                        ctx,
                        name,
                        store,
                        url,
                        worker=mode != "idle",
                        register_ack=OTHER_ACK[catalog_name] if mode == "load-other" else "auto",
                        worker_cpus="all" if mode == "paced-all" else None,
                    )
                    load: _Load | None = None
                    try:
                        if mode != "idle":
                            load = _Load(agent.url, ctx.ssd / name / "load", "bench-load")
                            load.start()
                            load.wait_steady()  # uploads, commits and replication under way
                        for rep in range(reps):
                            if rep and mode in PACED_MODES and load is not None:
                                # With the load held: a compaction beside
                                # its uploads took 17-109 s.
                                load.hold()
                                _compact(store)
                                load.go_on()
                            backlog = {"start": float(busy_jobs(agent.url))}
                            memory = {"start": meminfo_bytes("MemAvailable") or 0}
                            ticks = cpu_ticks()
                            durable, began = (load.durable_now() if load else 0), time.monotonic()
                            if mode in PACED_MODES:
                                samples = _paced_round(
                                    agent, ctx.ssd / name, rep, paced_count, floor_url
                                )
                            else:
                                samples = _round(
                                    agent, ctx.work, ctx.ssd / name, rep, count, mode, floor_url
                                )
                            samples["steal"] = [100 * steal_share(ticks, cpu_ticks())]
                            if load is not None:
                                # The uploads' pace: what confining them costs.
                                made = load.durable_now() - durable
                                samples["load_rate"] = [made / (time.monotonic() - began)]
                            backlog["end"] = float(busy_jobs(agent.url))
                            memory["end"] = meminfo_bytes("MemAvailable") or 0
                            samples.update({f"backlog_{k}": [v] for k, v in backlog.items()})
                            samples.update({f"memory_{k}": [v] for k, v in memory.items()})
                            samples["store_bytes"] = [size_bytes(store.data_dir)]
                            per_mode[mode].append(samples)
                            log(_round_line(catalog_name, mode, rep, reps, samples))
                    finally:
                        if load is not None:
                            load.stop()
                            load_totals[f"{catalog_name} {mode}"] = {
                                "load_registered": load.registered,
                                "load_durable": load.durable,
                                "load_errors": load.errors[:10],
                            }
                        ctx.stop_agent(agent)
                        _compact(store)
                results[catalog_name] = per_mode
            finally:
                for url in databases:
                    pg.drop_database(url, pg.postgres_admin_url())

    rows: list[dict[str, Any]] = []
    labels = {
        "idle": "idle (worker off)",
        "load": "under upload load (worker on, own process)",
        "load-other": "under upload load, the other register_ack (SQLite: committed, "
        "PostgreSQL: recorded)",
        "paced": "under upload load (worker on, own process)",
        "paced-all": 'under upload load, [worker] cpus = "all" (the background on every '
        "CPU, not the default)",
    }
    for catalog_name, per_mode in results.items():
        for call in ("register", "latest"):
            for mode in ("load", "load-other", "idle"):
                rows += _timed_rows(
                    f"{catalog_name} {call}, {labels[mode]}",
                    per_mode[mode],
                    call,
                    f"server_{call}",
                    target=mode == "load",
                )
        rows += _floor_rows(catalog_name, per_mode, ("load", "load-other", "idle"), labels)
    # The paced streams: the load's uploads are the background work.
    for catalog_name, per_mode in results.items():
        for call, label in (
            ("register", "register (files on T0)"),
            ("latest", "latest right after"),
            ("segment_stage", 'register of a memory segment (staging="memory")'),
            ("segment_stall", "memory staging stall (reservation if any + write + register)"),
        ):
            server = {"segment_stage": "segment_server_stage", "segment_stall": None}.get(
                call, f"server_{call}"
            )
            for mode in PACED_MODES:
                rows += _timed_rows(
                    f"{catalog_name} {label}, paced: one every {PACE_SECONDS * 1000:.0f} ms, "
                    f"{labels[mode]}",
                    per_mode[mode],
                    f"paced_{call}",
                    f"paced_{server}" if server else None,
                    target=call != "segment_stall",
                )
            confined_p99, all_p99 = (
                percentile([percentile(r[f"paced_{call}"], 99) for r in per_mode[m]], 50)
                for m in PACED_MODES
            )
            rows.append(
                _confined_ratio(
                    f"{catalog_name} {label}, paced", "p99 ratio", confined_p99 / all_p99
                )
            )
        rows += _floor_rows(catalog_name, per_mode, PACED_MODES, labels, paced=True)
    for catalog_name, per_mode in results.items():
        rates = {
            mode: [r["load_rate"][0] for r in per_mode[mode] if r.get("load_rate")]
            for mode in PACED_MODES
        }
        for mode in PACED_MODES:
            if rates[mode]:
                rows.append(
                    row(
                        f"{catalog_name} load checkpoints ({LOAD_FILES} × "
                        f"{LOAD_FILE_BYTES // MiB} MiB) made durable during the paced rounds, "
                        f"{labels[mode]}",
                        "per second",
                        "/s",
                        rates[mode],
                    )
                )
        if all(rates.values()):
            confined_rate, all_rate = (percentile(rates[m], 50) for m in PACED_MODES)
            rows.append(
                _confined_ratio(
                    f"{catalog_name} load checkpoints made durable",
                    "ratio",
                    confined_rate / all_rate,
                    note="below 1: what confining costs the uploads",
                )
            )
    for catalog_name, per_mode in results.items():
        for mode in ("load", "load-other", "idle"):
            rows += _timed_rows(
                f"{catalog_name} latest polled every {POLL_SECONDS * 1000:.0f} ms "
                f"(an orchestrator, apart from registrations), {labels[mode]}",
                per_mode[mode],
                "latest_polled",
                "server_latest_polled",
                target=mode == "load",
            )
    # The trainer's default path: a memory segment's register, and its
    # whole stall (reserve + write + register).
    for catalog_name, per_mode in results.items():
        for mode in ("load", "load-other"):
            rows += _timed_rows(
                f'{catalog_name} register of a memory segment (staging="memory", the default), '
                f"{labels[mode]}",
                per_mode[mode],
                "segment_stage",
                "segment_server_stage",
                target=mode == "load",
            )
            rows += _timed_rows(
                f"{catalog_name} memory staging stall (reservation if any + write + register), "
                f"{labels[mode]}",
                per_mode[mode],
                "segment_stall",
                None,
                target=False,
            )
    for catalog_name, per_mode in results.items():
        for mode in ("load", "load-other"):
            for phase in PHASES:
                for metric in ("p50", "p99"):
                    values = [
                        FIGURES[metric](s[f"phase_{phase}"])
                        for s in per_mode[mode]
                        if s.get(f"phase_{phase}")
                    ]
                    if values and max(values) > 0:
                        rows.append(
                            row(
                                f"{catalog_name} register {labels[mode]}, agent's phase: {phase}",
                                metric,
                                "ms",
                                values,
                            )
                        )
    for catalog_name, per_mode in results.items():
        for probe, what in (("fsync", "fdatasync of 4 KiB"), ("wake", "a 1 ms sleep's oversleep")):
            for metric in ("p50", "p99"):
                values = [FIGURES[metric](s[probe]) for s in per_mode["load"] if s.get(probe)]
                if values:
                    rows.append(
                        row(
                            f"{catalog_name} machine floor under load: {what}",
                            metric,
                            "ms",
                            values,
                        )
                    )
    for catalog_name, per_mode in results.items():
        for mode, streams in (
            ("load", "back-to-back streams"),
            ("paced", "paced streams"),
            ("paced-all", "paced streams"),
        ):
            for at in ("start", "end"):
                values = [r[f"backlog_{at}"][0] for r in per_mode[mode] if r.get(f"backlog_{at}")]
                if values:
                    rows.append(
                        row(
                            f"{catalog_name} worker backlog at the {at} of a round of the "
                            f"{streams}, {labels[mode]}",
                            "queued + running jobs",
                            "count",
                            values,
                        )
                    )
    for catalog_name, per_mode in results.items():
        for mode in MODES:
            values = [r["steal"][0] for r in per_mode[mode] if r.get("steal")]
            if values:
                rows.append(
                    row(
                        f"{catalog_name} machine floor, {mode} rounds: CPU steal (time the "
                        "hypervisor gave the machine's CPUs to others)",
                        "share",
                        "%",
                        values,
                    )
                )
    for catalog_name, per_mode in results.items():
        for mode in ("load", "idle"):
            rounds = [s.get("client_gc", []) for s in per_mode[mode]]
            if rounds:
                label = f"{catalog_name} timed client's cyclic collections, {labels[mode]}"
                rows.append(row(label, "count", "", [float(len(r)) for r in rounds]))
                rows.append(row(label, "ms in all", "ms", [sum(r) for r in rounds]))
    notes = [
        f"target: register and latest p99 ≤ {TARGET_P99_MS:.0f} ms under upload load, "
        "on SQLite and on PostgreSQL.",
        f"under load: {count} sequential register + latest of a {TINY_BYTES}-byte checkpoint per "
        f"round, {reps} round(s), after {WARMUP} warm-up; meanwhile {IN_FLIGHT} checkpoints of "
        f"{LOAD_FILES} × {LOAD_FILE_BYTES // MiB} MiB stay registered and not yet durable "
        "(two regions: upload, commit, replication; retention keep_last 4 and the scrubber "
        "every 2 s). The S3 server's data is on a tmpfs "
        f"({store_dir}), not the agent's disk.",
        "idle: the same agent configuration with TIERCKPT_WORKER__ENABLED=false. "
        "worker in its own process / in the agent's process: the same load with [worker] "
        'separate_process = "yes" / "no"; "auto", the default, is "yes" with either catalog. '
        "SQLite, worker process: its write transactions give the lock up to a waiting "
        "registration, and the thread holding it runs at the agent's niceness "
        f"({_lock_holder_priority()}).",
        "machine floor: probed in the benchmark's process during the loaded rounds, every "
        "50 ms: fdatasync of a 4 KiB write on the catalog's disk (each registration's commit "
        "is flushed by one, after the answer by default; the other helpers of this machine "
        "share the disk and the 2 cores) and how late a 1 ms sleep wakes up.",
        "machine floor, a call answered empty: after each timed register + latest, one POST "
        "(a registration's body) to a do-nothing ASGI app served as the agent is (uvicorn, "
        "uvloop, httptools; its own process), from the timed client's process with the "
        "client's httpx stack: what a call costs on this machine at that moment before an "
        "agent does any work (both processes' CPU, loopback, and their wake-ups; on a VM "
        "whose idle vCPUs halt, a halted vCPU's wake-up waits for the hypervisor). The "
        "register and latest p99s are bounded below by it.",
        "memory segment: in each round, after the register stream, the same count of "
        "sequential reserve, write, register of a segment and `latest` of a "
        f"{TINY_BYTES}-byte checkpoint in the agent's memory tier (what "
        'TorchCheckpointer(staging="memory"), the default, sends). Its register is '
        "recorded in the segment, not the catalog: the agent writes it to T0 and registers "
        "it there afterwards, so those are uploaded too and add to the load. The register "
        "stream above is the path of files already on T0 (CheckpointClient.register, "
        'staging="disk", orchestrators): answered once recorded in the agent\'s inbox on T0 '
        'after one read of the catalog ([catalog] register_ack = "recorded", the default on '
        "SQLite; the catalog's write and its fsync follow behind the answer), or at its "
        'commit ("committed", the default on PostgreSQL); "the other register_ack" rows '
        "measure each catalog the other way under the same load.",
        f"paced: on an agent of its own under the same load, {paced_count} register + "
        f"latest of the files path, then {paced_count} memory-segment saves, one every "
        f"{PACE_SECONDS * 1000:.0f} ms (start to start) instead of back to back: a node's "
        "trainers register a few checkpoints a second at most, so the background work the "
        "registrations meet is the load's uploads, commits, replication, scrubbing and "
        "retention. The back-to-back rows are a stress form: their hundreds of tiny "
        "checkpoints a round leave the worker a backlog that grows from round to round "
        "(the worker backlog rows), and the agent, its worker and the store keep both cores "
        "busy with the timed client's own work.",
        'cpus: every agent but paced-all\'s runs with the default [worker] cpus = "auto": its '
        "worker process and memory tier's T0 writer on CPU(s) "
        f"{format_list(BACKGROUND_CPUS)} of this machine (the highest quarter); the agent's "
        "requests, the timed client, the load's trainer process and PostgreSQL run on any "
        'CPU. paced, cpus = "all": the same paced streams with the background on every CPU, '
        "a configuration users choose, labelled apart; the ratio rows put the default's "
        "p99s and its uploads' pace against that one's. The store's threads run on "
        f"CPU(s) {format_list(BACKGROUND_CPUS)} in every mode: it stands for a store on "
        "other machines, which takes none of the node's CPU; there it slows the uploads, "
        "as a remote store would not, rather than the calls.",
        "the store's volumes are compacted after each mode and between paced rounds: the "
        "load's deleted checkpoints stay in SeaweedFS's volumes (on the tmpfs: the node's "
        "memory) until then, about 9 GiB a paced round; each round line gives the memory "
        "available at its start and end and the tmpfs the store occupied.",
        "`agent's own`: the median over rounds of the agent's request-log duration for the "
        "same requests (the rest of the client figure is HTTP and the client's own scan).",
        "agent's phases (its request log, each phase's own percentile): scan (the files' "
        "listing), record (the catalog's read and the inbox record, the default path), "
        "queued (behind an earlier batch of the group commit), gate (SQLite: the "
        "in-process write gate), lock (SQLite: the database's write lock, held by a background "
        "transaction or the worker process; PostgreSQL: a pooled connection), write (the "
        "statements), commit (SQLite: the COMMIT, which releases the lock; PostgreSQL: in "
        "write, its WAL flush after the answer by default), sync (SQLite, only with "
        'register_ack = "on_disk": the fsync of the WAL the answer waits for).',
        "timed client's cyclic collections: Python's collector in the benchmark's process "
        "(the trainer's, for the client) during each round's three timed streams "
        f"({3 * (WARMUP + count)} register, latest and memory-segment calls and their "
        "follow-ups), count and time in all per round: each one stops the calling thread "
        "inside whichever call triggers it.",
        f"load process: {json.dumps(load_totals)}",
    ]
    return rows, notes, {"count": count, "rounds": results, "load": load_totals}


# -- idle, by size -----------------------------------------------------------------


def _by_size(ctx: BenchContext) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    count = 50 if ctx.quick else 200
    base = ctx.ssd / "latency"
    small = base / "small"
    large = base / "large"
    write_random(small / "model.bin", SMALL_BYTES)
    sparse_file(large / "model.bin", LARGE_BYTES)
    allocated = (large / "model.bin").stat().st_blocks * 512

    agent = ctx.start_agent("latency", worker=False)
    try:
        with CheckpointClient(agent.url) as client:
            sources = {
                "small": ("bench-latency-small", small),
                "large": ("bench-latency-large", large),
            }
            last_step = {"small": 0, "large": 0}

            def register(kind: str) -> float:
                run_name, path = sources[kind]
                last_step[kind] += 1
                step = last_step[kind]
                began = time.perf_counter()
                answer = client.register(run_name, step, path)
                elapsed = time.perf_counter() - began
                if answer.state != "registered":
                    raise RuntimeError(f"register {run_name}:{step} answered {answer.state}")
                return elapsed * 1000

            for _ in range(WARMUP):
                register("small")
                register("large")
            rounds: list[dict[str, list[float]]] = []
            for number in range(ctx.reps):
                samples: dict[str, list[float]] = {"small": [], "large": []}
                for i in range(count):
                    order = ("small", "large") if i % 2 == 0 else ("large", "small")
                    for kind in order:
                        samples[kind].append(register(kind))
                rounds.append(samples)
                log(
                    f"register round {number + 1}/{ctx.reps}: p50 small "
                    f"{percentile(samples['small'], 50):.1f} ms, large "
                    f"{percentile(samples['large'], 50):.1f} ms"
                )
            detail = client.get("bench-latency-large", last_step["large"])
    finally:
        ctx.stop_agent(agent)

    rows: list[dict[str, Any]] = []
    for metric, figure in FIGURES.items():
        by_size = {
            kind: [figure(samples[kind]) for samples in rounds] for kind in ("small", "large")
        }
        rows.append(row("idle (worker off): 1 MiB checkpoint", metric, "ms", by_size["small"]))
        rows.append(
            row(
                "idle (worker off): 10 GiB checkpoint (sparse)",
                metric,
                "ms",
                by_size["large"],
                ratio_label="large / small",
                ratio_values=ratios(by_size["large"], by_size["small"]),
                note="" if metric == "max" else "10240× the bytes",
            )
        )
    notes = [
        f"by size: {count} registrations per size per round, {ctx.reps} rounds, after {WARMUP} "
        "warm-up each; sync CheckpointClient.register over keep-alive HTTP, SQLite catalog, "
        "a separate agent with TIERCKPT_WORKER__ENABLED=false (the sparse file has "
        f"{allocated} bytes allocated on disk).",
    ]
    details = {
        "registrations_per_round": count,
        "rounds": rounds,
        "large_bytes": LARGE_BYTES,
        "large_allocated_bytes": allocated,
        "small_bytes": SMALL_BYTES,
        "large_total_bytes_in_catalog": detail.total_bytes,
    }
    return rows, notes, details
