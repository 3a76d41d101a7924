"""Registering staged segments as a disk save would, and writing them to T0.

First the registration, through the registration writer's group commit
(the code path of ``POST /v1/checkpoints``), with the segment's listing as
that of the T0 path it will have: the upload job starts at once and reads
the files from the segment (service.py, ``open_file``). Then (by default
at once, during that upload; with ``[memory] t0_wait_seconds`` once it has
ended: upload_first.py says why, and what it risks) the files are copied
into a hidden sibling of that T0 path, given the segment files' mtimes
(the registered ones), fsynced, and the directory renamed into
place: T0 shows all or nothing, as a trainer's own save does. One T0 write
at a time (T0's bandwidth is the limit, not the CPU).

Killed at any moment, the agent finds the segment still staged at restart
(``persisted.json`` is written last), registers it again (the same listing:
answered as already registered), drops the hidden directory of the attempt
and copies again; a T0 directory renamed into place before the kill is
recognised (same files and sizes) and kept. Should the memory be lost with
the node before T0 holds the files, the upload finds neither copy and fails
the checkpoint: it never becomes durable with bytes it does not have.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...client._files import fsync_dir
from .. import cpu_affinity
from ..checkpoints.batching import RegistrationBatcher
from ..checkpoints.scan import ScannedFile, ScannedShard, root_of
from ..checkpoints.schemas import RegisterRequest
from ..checkpoints.service import submit_scanned
from ..errors import ApiError
from ..resources import Resources
from . import direct_copy, upload_first
from .arena import Arena, Segment

log = logging.getLogger("tierckpt.memory")

PERSIST_PREFIX = ".tierckpt-persist-"
RETRY_BASE, RETRY_MAX = 0.5, 30.0
T0_POLL = 0.1


class TargetTaken(Exception):
    """The checkpoint cannot be written there: the T0 path holds other files,
    or left the roots, or the segment no longer holds its files."""


def _same_layout(target: Path, files: dict[str, int]) -> bool:
    found: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(target):
        for name in names:
            path = Path(dirpath) / name
            found[path.relative_to(target).as_posix()] = path.stat().st_size
    return found == files


def open_beneath(root: Path, relative: str) -> int:
    """Open ``root/relative`` for reading without following any symlink on
    the way (the trainer writes into the segment: a directory swapped for a
    symlink after the registration's check must not make the agent read,
    and upload, a file from elsewhere)."""
    parts = relative.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = inner
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def copy_file(segment: Segment, relative: str, destination: Path) -> None:
    """A direct write around the page cache (direct_copy.py), then fsync."""
    try:
        src = open_beneath(segment.data, relative)
    except OSError as exc:  # a symlink on the way, or the file is gone
        raise TargetTaken(
            f"the segment's {relative} cannot be read as a plain file ({exc.strerror}); "
            "it was changed after the registration"
        ) from exc
    size = segment.files[relative]
    try:
        dst = direct_copy.create(destination)
        try:
            direct_copy.copy(src, dst, size)
            # The registered mtime: the upload's and the T0 checks compare it.
            info = os.fstat(src)
            os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _confined(directory: Path, roots: list[Path]) -> None:
    if root_of(Path(os.path.realpath(directory)), roots) is None:
        raise TargetTaken(f"{directory} no longer resolves under the configured local roots")


def write_to_t0(segment: Segment, target: Path, roots: list[Path]) -> None:
    """Copy the segment's files to ``target`` (all or nothing, fsynced)."""
    if target.exists():
        if _same_layout(target, segment.files):
            return  # renamed into place by an earlier attempt that was killed
        raise TargetTaken(
            f"{target} exists with other files; the memory-staged checkpoint was not "
            "written there (its bytes stay in the arena until freed)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    _confined(target.parent, roots)
    staging = target.parent / f"{PERSIST_PREFIX}{segment.id}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    directories = {staging}
    for relative in sorted(segment.files):
        destination = staging / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        directories.add(destination.parent)
        copy_file(segment, relative, destination)
    for directory in directories:
        fsync_dir(directory)
    staging.chmod(0o755)
    # Checked at staging time; again now, just before the rename: the
    # directory must still resolve under a configured root.
    _confined(target.parent, roots)
    os.rename(staging, target)
    fsync_dir(target.parent)


def scan_segment(segment: Segment, target: Path) -> ScannedShard:
    """The segment's files listed as registration lists a directory (names,
    sizes, mtimes), as the T0 directory ``target`` will hold them."""
    files = []
    for relative in sorted(segment.files):
        try:
            fd = open_beneath(segment.data, relative)
        except OSError as exc:
            raise TargetTaken(
                f"the segment's {relative} cannot be read as a plain file ({exc.strerror}); "
                "it was changed after the registration"
            ) from exc
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
        if info.st_size != segment.files[relative]:
            raise TargetTaken(f"the segment's {relative} changed size after the registration")
        files.append(ScannedFile(path=relative, size=info.st_size, mtime_ns=info.st_mtime_ns))
    return ScannedShard(directory=target, files=files)


def _background_thread(niceness: int, cpus: frozenset[int]) -> None:
    """Run by the T0 writer thread as it starts: Linux schedules threads one
    by one, so this thread alone yields the CPU (its kernel copies are
    charged to it) while the upload of the same checkpoint, the copy that
    makes it durable, hashes and sends; and it runs on the background CPUs
    (``[worker] cpus``) with the worker, away from the agent's requests."""
    try:
        cpu_affinity.confine_thread(cpus, "the memory tier's T0 writer")
    except ValueError as exc:  # `tierckpt serve` refuses this before it starts
        log.warning("the T0 writer thread runs on any CPU: %s", exc)
    if niceness <= 0:
        return
    try:
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + niceness))
    except (OSError, AttributeError) as exc:  # not Linux, or not allowed: equal shares
        log.debug("the T0 writer thread keeps its priority: %s", exc)


class SegmentPersister:
    """The agent's task that takes staged segments to the catalog at once,
    and to T0 (once their upload has ended, with ``t0_wait_seconds``:
    upload_first.py)."""

    def __init__(
        self,
        resources: Resources,
        registrations: RegistrationBatcher,
        arena: Arena,
        keep_newest: bool,
        persist_nice: int = 0,
        cpus: frozenset[int] = frozenset(),
        t0_wait_seconds: float = 0.0,
    ) -> None:
        self.resources = resources
        self.registrations = registrations
        self.arena = arena
        self.keep_newest = keep_newest
        self.persist_nice = persist_nice
        self.cpus = cpus
        self.t0_wait_seconds = t0_wait_seconds
        self._writer: ThreadPoolExecutor | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._not_before: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        # Segments registered in this agent's life -> when (monotonic); a
        # restarted agent registers its staged ones again (answered as
        # registered already) before it writes them.
        self._registered: dict[str, float] = {}
        self._pressed = False

    def wake(self) -> None:
        self._wake.set()

    def press(self) -> None:
        """A reservation found the arena full: what waits for T0 goes now
        (its memory is freed once T0 holds it)."""
        self._pressed = True
        self._wake.set()

    def start(self) -> asyncio.Task[None]:
        # One segment at a time, on a thread of its own (see _background_thread).
        self._writer = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="memory-t0-writer",
            initializer=_background_thread,
            initargs=(self.persist_nice, self.cpus),
        )
        self._task = asyncio.create_task(self._run(), name="memory-persist")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        # A copy in progress finishes in its thread (it cannot be interrupted);
        # the segment stays staged and is taken up again at the next start.
        if self._writer is not None:
            self._writer.shutdown(wait=False, cancel_futures=True)
            self._writer = None

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            due = [s for s in self.arena.staged() if self._not_before.get(s.id, 0.0) <= now]
            for segment in due:
                if segment.id not in self._registered:
                    await self.register(segment)
            registered = [s for s in due if s.id in self._registered and s.state == "staged"]
            # Read only where the writes may wait; a copy evicted meanwhile is
            # caught after its write either way (``write``).
            holds = self.t0_wait_seconds > 0 and not self._pressed
            states = await self._states(registered) if holds else {}
            for segment in self._t0_due(registered, states) if holds else registered:
                state = states.get(_shard(segment))
                if state is not None and state.evicted:
                    self._not_wanted(segment)
                else:
                    await self.write(segment)
            waiting = any(
                s.id in self._registered and s.state == "staged" for s in self.arena.staged()
            )
            if not waiting:
                self._pressed = False
            self.arena.reclaim_abandoned()
            self._registered = {
                k: v for k, v in self._registered.items() if k in self.arena.segments
            }
            waits = [t - time.monotonic() for t in self._not_before.values()]
            # While a T0 write waits for an upload, the catalog is asked
            # again every T0_POLL seconds.
            polling = waiting and self.t0_wait_seconds > 0
            timeout = max(0.05, min([T0_POLL if polling else 5.0, *waits]))
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _states(
        self, segments: list[Segment]
    ) -> dict[upload_first.Shard, upload_first.ShardState]:
        """The catalog's word on the shards of ``segments``; none when it
        cannot be read (the catalog down: T0 is the copy that needs none)."""
        if not segments:
            return {}
        try:
            return await self.resources.rows.read(
                upload_first.shard_states, [_shard(s) for s in segments]
            )
        except Exception as exc:
            log.warning("memory tier: upload states not read (%s); writing to T0 now", exc)
            return {}

    def _t0_due(
        self,
        segments: list[Segment],
        states: dict[upload_first.Shard, upload_first.ShardState],
    ) -> list[Segment]:
        """Those of ``segments`` (registered, their writes allowed to wait) to
        write to T0 now: those whose upload ended (or is not known to run) or
        whose wait is over (upload_first.py)."""
        now = time.monotonic()
        due = []
        for segment in segments:
            state = states.get(_shard(segment))
            waited = now - self._registered[segment.id]
            if state is None or not state.uploading or waited >= self.t0_wait_seconds:
                due.append(segment)
        return due

    def _not_wanted(self, segment: Segment) -> None:
        """T0 eviction passed over the checkpoint (durable, beyond the newest
        kept) before its T0 copy existed: none is written, the segment is freed."""
        log.debug("memory segment %s: its T0 copy was evicted before it was written", segment.id)
        self._settled(segment)
        self.arena.release(segment.id)

    def _settled(self, segment: Segment) -> None:
        """Its retries are over: it reached T0, or no T0 copy is wanted."""
        self._not_before.pop(segment.id, None)
        self._failures.pop(segment.id, None)

    async def register(self, segment: Segment) -> None:
        """The segment's registration, as a save to its T0 path would make
        it: its upload starts at once, reading the segment."""
        assert segment.registration is not None
        request = RegisterRequest.model_validate(segment.registration)
        target = Path(request.path)
        try:
            scanned = await asyncio.to_thread(scan_segment, segment, target)
            # No drain check: the agent accepted this checkpoint when it was staged.
            await submit_scanned(self.registrations, request, scanned)
        except Exception as exc:
            self._failed(segment, exc)
            return
        self._registered[segment.id] = time.monotonic()

    async def write(self, segment: Segment) -> None:
        """The registered segment's files to T0 (all or nothing, fsynced)."""
        assert segment.registration is not None
        request = RegisterRequest.model_validate(segment.registration)
        target, roots = Path(request.path), self.resources.settings.local.roots
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._writer, write_to_t0, segment, target, roots
            )
        except Exception as exc:
            self._failed(segment, exc)
            return
        state = (await self._states([segment])).get(_shard(segment))
        if state is not None and state.evicted:  # marked during the write
            await asyncio.to_thread(shutil.rmtree, target, True)
            self._not_wanted(segment)
            return
        self._settled(segment)
        self.arena.mark_persisted(segment, request.path)
        self.arena.free_older(segment, self.keep_newest)
        log.debug("memory segment %s persisted to %s", segment.id, request.path)

    def _failed(self, segment: Segment, exc: Exception) -> None:
        """A refusal (4xx, TargetTaken) fails the segment; anything else (T0
        full or unwritable, the catalog down) is tried again later."""
        if isinstance(exc, TargetTaken) or (isinstance(exc, ApiError) and exc.status < 500):
            message = getattr(exc, "message", None) or str(exc)
            log.error(
                "memory segment %s (%s step %d) not registered: %s",
                segment.id,
                segment.run,
                segment.step,
                message,
            )
            self.arena.mark_failed(segment, message)
            return
        self._retry_later(segment, exc)

    def _retry_later(self, segment: Segment, exc: BaseException) -> None:
        failures = self._failures.get(segment.id, 0) + 1
        self._failures[segment.id] = failures
        delay = min(RETRY_MAX, RETRY_BASE * 2 ** (failures - 1))
        self._not_before[segment.id] = time.monotonic() + delay
        log.warning(
            "memory segment %s (%s step %d) not persisted yet (attempt %d, retry in %.1f s): %s",
            segment.id,
            segment.run,
            segment.step,
            failures,
            delay,
            exc,
        )


def _shard(segment: Segment) -> upload_first.Shard:
    assert segment.step is not None
    return (segment.run, segment.step, segment.rank)
