"""The trainer's side: :class:`TorchCheckpointer` saves a training loop's
state and registers it, and resumes from the latest valid checkpoint (this
rank's T0 copy when this node still holds it intact, else a verified
download).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._files import fsync_file
from .._node import check_node, default_node
from ..errors import (
    CheckpointFailedError,
    ConflictError,
    NotFoundError,
    ServerError,
    TierckptError,
)
from ..models import Checkpoint, MemoryInfo, MemorySegment
from ..sync_client import CheckpointClient
from .checkpoint_dir import (
    RESTORE_PREFIX,
    STAGING_PREFIX,
    Stateful,
    TrainingState,
    encode_state,
    load_state,
    same_files,
    save_state,
    sha256_of,
    write_state,
)
from .memory_stage import StagedFiles
from .segment_holds import SegmentHolds
from .segment_mappings import Mappings

log = logging.getLogger("tierckpt.client.torch")

# The agent's answers for a segment it no longer has (released, reclaimed),
# and for a step and rank being staged already (a replayed step).
SEGMENT_GONE, SEGMENT_TAKEN = "segment_not_found", "segment_exists"


@dataclass(frozen=True)
class Restored:
    """Where the last ``restore_latest`` came from."""

    step: int
    source: str  # "memory" (this node's memory tier), "local" (its T0 copy) or "region"
    region: str | None
    seconds: float
    path: str | None = None
    regions: tuple[str, ...] = ()  # where the checkpoint is committed


class TorchCheckpointer:
    """Save and resume a PyTorch training loop through a tierckpt agent.

    ``root`` is a directory under the agent's ``[local].roots``; checkpoints go
    to ``root/run/step-N`` (``…/step-N/rank-R`` when ``world_size > 1``: then
    every rank saves its own state, RNGs included, and restores only its own).

    ``staging`` says where ``save`` puts the state before it returns:
    ``"memory"`` copies it into the agent's memory tier (a segment in its
    shared-memory arena, in the very files T0 gets) and registers it; the
    agent writes it to T0 and uploads it afterwards. ``"disk"`` writes the
    files to T0 (fsynced) and registers them. None (the default): memory
    when the agent has a memory tier, else disk. A save that does not fit in
    memory waits for room or is written to disk, as the agent's
    ``[memory] when_full`` says; it is never dropped. ``send_hashes`` needs
    the files on disk, so it implies disk staging.

    Between memory-staged saves the checkpointer holds a segment the agent
    reserved for the next save; ``close()`` (or leaving a ``with`` block)
    gives it back when training is over.
    """

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        root: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data: Stateful | None = None,
        generators: Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        node: str | None = None,
        fsync: bool = True,
        send_hashes: bool = False,
        staging: str | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if staging not in (None, "memory", "disk"):
            raise ValueError(f"staging must be 'memory', 'disk' or None, not {staging!r}")
        self.staging = staging
        self._memory: MemoryInfo | None = None
        self._mappings = Mappings()  # of the segment prepared for the next save
        # The segment the agent reserved for the next save when it staged the
        # last one (one call per save instead of two), and its files' sizes.
        self._ahead: MemorySegment | None = None
        self._ahead_sizes: dict[str, int] = {}
        self._ahead_lease = 0.0  # its lease in seconds when it was handed out
        # Locks that tell the agent this trainer still holds its reserved
        # segments: a trainer killed -9 lets them go (segment_holds.py).
        self._holds = SegmentHolds()
        self.client = client
        self.run = run
        self.root = Path(os.path.abspath(root))
        self.objects: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "data": data,
            "generators": dict(generators or {}),
        }
        self.rank, self.world_size = rank, world_size
        self.node = node or default_node()
        self.fsync = fsync
        self.send_hashes = send_hashes
        self.restored: Restored | None = None
        self.state: TrainingState | None = None  # what the last restore loaded
        self._parent: int | None = None
        self._clean_leftovers()

    def close(self) -> None:
        """Give back what the checkpointer holds between saves: the segment
        the agent reserved for the next save (else held until its lease
        ends, the size of a whole state) and the mapping prepared for it.
        Saves before it are unaffected (the agent finishes them); a
        save after it works and reserves anew. Idempotent."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._release(ahead.id, retry=False)
        self._holds.close()
        self._mappings.close()

    def __enter__(self) -> TorchCheckpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def run_dir(self) -> Path:
        return self.root / self.run

    def path_of(self, step: int) -> Path:
        path = self.run_dir / f"step-{step}"
        return path / f"rank-{self.rank:05d}" if self.world_size > 1 else path

    def _clean_leftovers(self) -> None:
        # Staging and restore directories of an earlier life of this rank,
        # killed mid-write or mid-restore: never registered, never complete.
        if not self.run_dir.is_dir():
            return
        if self.world_size == 1:
            pattern = f"{STAGING_PREFIX}step-*"
        else:
            pattern = f"step-*/{STAGING_PREFIX}rank-{self.rank:05d}-*"
        leftovers = [*self.run_dir.glob(pattern)]
        leftovers += self.run_dir.glob(f"{RESTORE_PREFIX}*-rank{self.rank}-*")
        for entry in leftovers:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- save ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        extra: Any = None,
        priority: str = "normal",
        wait_durable: float | None = None,
    ) -> Checkpoint:
        """Write the state of ``step`` to local SSD and register it; returns at
        once unless ``wait_durable`` (seconds) asks to wait until the copy is
        durable (the last save before a preemption).

        Saving a step again (a resumed run replaying steps) keeps the first
        copy when the bytes are the same; if they differ and the first one is
        registered already, it stays, with a warning: a step is immutable.
        """
        began = time.monotonic()
        target = self.path_of(step)
        o = self.objects
        state = {
            "step": step,
            "epoch": epoch,
            "extra": extra,
            "model": o["model"],
            "optimizer": o["optimizer"],
            "scheduler": o["scheduler"],
            "data": o["data"],
            "generators": o["generators"],
        }
        if not target.exists() and self._stages_in_memory():
            staged = self._save_in_memory(
                target,
                state,
                began,
                metrics=metrics,
                metadata=metadata,
                priority=priority,
                epoch=epoch,
            )
            if staged is not None:
                self._parent = step
                return self._wait(staged, wait_durable)
        if target.exists():
            existing = self._resave(target, state)
            if existing is not None:
                return self._wait(existing, wait_durable)
        else:
            save_state(target, fsync=self.fsync, **state)
        files = None
        if self.send_hashes:
            files = {
                p.relative_to(target).as_posix(): sha256_of(p)
                for p in target.rglob("*")
                if p.is_file()
            }
        written = time.monotonic() - began
        try:
            checkpoint = self.client.register(
                self.run,
                step,
                target,
                rank=self.rank,
                world_size=self.world_size,
                metrics=metrics,
                parent=self._parent,
                priority=priority,
                epoch=epoch,
                metadata=metadata,
                files=files,
                write_seconds=written,
            )
        except ConflictError as exc:
            log.warning("%s step %d not registered: %s", self.run, step, exc.message)
            checkpoint = self.client.get(self.run, step)
        self._parent = step
        log.debug("%s step %d: %.3f s write + register", self.run, step, time.monotonic() - began)
        return self._wait(checkpoint, wait_durable)

    # -- memory staging -------------------------------------------------------------------

    def memory_tier(self) -> MemoryInfo:
        """The agent's memory tier, asked once (disabled when it has none or
        is too old to say)."""
        if self._memory is None:
            try:
                self._memory = self.client.memory_info()
                check_node(self.node, self._memory.node, getattr(self.client, "base_url", ""))
            except TierckptError as exc:
                log.info("agent memory tier unknown (%s); staging on disk", exc)
                return MemoryInfo(enabled=False)
        return self._memory

    def _stages_in_memory(self) -> bool:
        if self.staging == "disk" or self.send_hashes:
            return False
        return self.memory_tier().enabled

    def _save_in_memory(
        self,
        target: Path,
        state: dict[str, Any],
        began: float,
        **register: Any,
    ) -> Checkpoint | None:
        """Copy the state into a segment of the agent's memory tier and
        register it; None when it goes to disk instead (no room, as the
        agent's policy says, or the agent is unreachable)."""
        step = state["step"]
        files = StagedFiles.of(encode_state(**state))
        sizes = files.sizes()
        ahead = self._take_ahead(sizes, fixed=set(files.layouts))
        if ahead is not None:
            try:
                return self._stage(ahead, files, sizes, target, state, began, **register)
            except ConflictError as exc:  # the same step is being staged (a replay)
                if exc.code != SEGMENT_TAKEN:
                    raise
                log.info("%s step %d: %s; writing to disk", self.run, step, exc.message)
                return None
            except ServerError as exc:  # its small files grew past the budget
                if exc.code != "memory_full":
                    raise
                log.info("%s step %d: %s", self.run, step, exc.message)
            except NotFoundError as exc:
                if exc.code != SEGMENT_GONE:
                    raise
                # Reclaimed after all (an agent started on a new arena, say):
                # the save is reserved and written again.
                log.info("%s step %d: the segment reserved ahead is gone (%s)", self.run, step, exc)
        segment = self._reserve(step, sizes)
        if segment is None:
            return None
        return self._stage(segment, files, sizes, target, state, began, **register)

    def _stage(
        self,
        segment: MemorySegment,
        files: StagedFiles,
        sizes: dict[str, int],
        target: Path,
        state: dict[str, Any],
        began: float,
        **register: Any,
    ) -> Checkpoint | None:
        """Write ``files`` into ``segment`` and register it (asking for the
        next save's segment when the agent can reserve it)."""
        step = state["step"]
        self._holds.hold(segment)  # the one reserved ahead is held already
        try:
            files.write(Path(segment.path), self._mappings)
        except OSError as exc:  # the arena's file system is full after all
            log.warning(
                "%s step %d: memory staging failed (%s); writing to disk", self.run, step, exc
            )
            self._release(segment.id)
            return None
        written = time.monotonic() - began
        try:
            checkpoint = self.client.register_segment(
                segment.id,
                self.run,
                step,
                target,
                rank=self.rank,
                world_size=self.world_size,
                parent=self._parent,
                write_seconds=written,
                reserve_next=self.memory_tier().reserve_next,
                **register,
            )
        except NotFoundError as exc:
            if exc.code != SEGMENT_GONE:
                self._release(segment.id)
            raise
        except BaseException:
            self._release(segment.id)
            raise
        finally:
            # Staged (the agent's now), refused or given back: not ours any more.
            self._holds.let_go(segment.id)
        self._ahead, self._ahead_sizes = checkpoint.next_segment, sizes
        if self._ahead is not None:
            self._holds.hold(self._ahead)
            if self._ahead.expires_at is not None:
                self._ahead_lease = self._ahead.expires_at.timestamp() - time.time()
            # Its files mapped (and a new file's pages allocated) while the
            # trainer trains, not in the next save's stall.
            self._mappings.prepare(
                Path(self._ahead.path), {name: sizes[name] for name in files.layouts}
            )
        log.debug(
            "%s step %d: %.3f s copy into memory + register",
            self.run,
            step,
            time.monotonic() - began,
        )
        return checkpoint

    def _take_ahead(self, sizes: dict[str, int], fixed: set[str]) -> MemorySegment | None:
        """The segment reserved ahead, if it holds the same files (the
        ``fixed`` ones, written in place, of the same sizes; the small ones,
        rewritten whole, may differ: the agent takes their sizes), is still
        there, and has at least half its lease left (as much time for the copy
        as a reservation made now would give); else it is given back (None)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        left = ahead.expires_at.timestamp() - time.time() if ahead.expires_at else 0.0
        same = self._ahead_sizes.keys() == sizes.keys() and all(
            self._ahead_sizes[name] == sizes[name] for name in fixed
        )
        if same and left >= self._ahead_lease / 2 and Path(ahead.path).is_dir():
            return ahead
        self._release(ahead.id)
        return None

    def _reserve(self, step: int, sizes: dict[str, int]) -> Any:
        tier = self.memory_tier()
        deadline = time.monotonic() + tier.wait_seconds
        delay = 0.05
        while True:
            try:
                return self.client.reserve_segment(
                    self.run, step, sizes, rank=self.rank, world_size=self.world_size
                )
            except ServerError as exc:
                waiting = exc.code == "memory_full" and tier.when_full == "wait"
                if not waiting or time.monotonic() + delay > deadline:
                    log.info(
                        "%s step %d not staged in memory (%s); writing to disk",
                        self.run,
                        step,
                        exc.message,
                    )
                    return None
            except ConflictError as exc:  # the same step is being staged (a replay)
                log.info("%s step %d: %s; writing to disk", self.run, step, exc.message)
                return None
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def _release(self, segment_id: str, retry: bool = True) -> None:
        try:
            self.client.release_segment(segment_id, retry=retry)
        except TierckptError as exc:  # the lease, or the lock let go below, reclaims it
            log.warning("memory segment %s not released: %s", segment_id, exc)
        finally:
            self._holds.let_go(segment_id)

    def _resave(self, target: Path, state: dict[str, Any]) -> Checkpoint | None:
        """``target`` exists from an earlier life. Keep it if it holds the same
        bytes (return None: register it, idempotently); replace it if it was
        never registered; keep the registered one otherwise (returned)."""
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}-", dir=target.parent)
        )
        try:
            write_state(scratch, fsync=False, **state)
            if same_files(scratch, target):
                return None
            try:
                registered: Checkpoint | None = self.client.get(self.run, state["step"])
            except NotFoundError:
                registered = None
            mine = registered is not None and any(s.rank == self.rank for s in registered.shards)
            if mine and registered is not None and registered.state not in ("failed", "deleted"):
                log.warning(
                    "%s step %d was registered before with other content (nondeterministic "
                    "training?); keeping the registered one",
                    self.run,
                    state["step"],
                )
                self._parent = state["step"]
                return registered
            shutil.rmtree(target)
            if self.fsync:
                for path in scratch.iterdir():
                    fsync_file(path)
            scratch.chmod(0o755)
            os.rename(scratch, target)
            return None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def wait_durable(self, step: int, timeout: float) -> Checkpoint:
        """Wait up to ``timeout`` seconds for a saved step to be durable (e.g.
        on preemption, when the last save was a normal one); returns it in
        whatever state it reached."""
        return self._wait(self.client.get(self.run, step), timeout)

    def _wait(self, checkpoint: Checkpoint, timeout: float | None) -> Checkpoint:
        if timeout is None:
            return checkpoint
        try:
            return self.client.wait(self.run, checkpoint.step, state="durable", timeout=timeout)
        except (TimeoutError, CheckpointFailedError) as exc:
            log.warning("%s step %d not durable: %s", self.run, checkpoint.step, exc)
            return self.client.get(self.run, checkpoint.step)

    # -- restore ------------------------------------------------------------------------

    def restore_latest(
        self,
        *,
        region: str | None = None,
        restore_rngs: bool = True,
        newest_on_node: bool = False,
    ) -> int:
        """Load the latest valid checkpoint of the run into the objects;
        returns its step (the number of steps done), 0 when there is none.

        It is read from this node's memory tier when that holds it (about
        the time of a copy), else from the node's T0 copy, else downloaded.
        ``newest_on_node`` (single-rank runs only): resume from the newest
        checkpoint this node holds, in memory or on T0, even one not durable
        yet. That saves the steps since the last durable one, at a risk: if
        the node is lost before it becomes durable, a restart elsewhere goes
        back to the older durable one (docs/API.md, "The memory tier")."""
        began = time.monotonic()
        latest = self._latest(region, newest_on_node and self.world_size == 1)
        if latest is None:
            self.restored, self.state = None, None
            return 0
        kwargs: dict[str, Any] = {
            "model": self.objects["model"],
            "optimizer": self.objects["optimizer"],
            "scheduler": self.objects["scheduler"],
            "data": self.objects["data"],
            "generators": self.objects["generators"],
            "restore_rngs": restore_rngs,
        }
        state, source, path = self._load_on_node(latest, kwargs)
        if state is None and latest.durable_step != latest.step and latest.durable_step is not None:
            # Not durable and unreadable here: the durable one is downloadable.
            latest = self.client.latest(self.run, region=region, node=self.node)
            if latest is None:
                self.restored, self.state = None, None
                return 0
            state, source, path = self._load_on_node(latest, kwargs)
        used_region = None
        if state is None:
            source = "region"
            self.run_dir.mkdir(parents=True, exist_ok=True)
            scratch = Path(
                tempfile.mkdtemp(
                    prefix=f"{RESTORE_PREFIX}{latest.step}-rank{self.rank}-", dir=self.run_dir
                )
            )
            try:
                restored = self.client.restore(
                    self.run,
                    scratch / "ckpt",
                    step=latest.step,
                    region=region,
                    rank=self.rank if self.world_size > 1 else None,
                )
                state = load_state(restored, **kwargs)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            used_region = region or (latest.locations[0].region if latest.locations else None)
        self._parent = latest.step
        self.state = state
        self.restored = Restored(
            step=latest.step,
            source=source,
            region=used_region,
            seconds=time.monotonic() - began,
            path=path,
            regions=tuple(location.region for location in latest.locations),
        )
        return state.step

    def _latest(self, region: str | None, newest_on_node: bool) -> Checkpoint | None:
        """The checkpoint to resume from, with where this node holds it."""
        if not self.memory_tier().enabled and not newest_on_node:
            return self.client.latest(self.run, region=region, node=self.node)
        on_node = self.client.latest(self.run, region=region, node=self.node, scope="node")
        if on_node is None or newest_on_node or on_node.step == on_node.durable_step:
            return on_node
        return self.client.latest(self.run, region=region, node=self.node)

    def _load_on_node(
        self, latest: Checkpoint, kwargs: dict[str, Any]
    ) -> tuple[TrainingState | None, str, str | None]:
        """Load ``latest`` from this node's memory tier or T0 copy, when they
        hold it intact; (None, …) when neither does."""
        places: list[tuple[str, str]] = [
            ("memory", m.path) for m in latest.memory if m.rank == self.rank
        ]
        local = latest.local.of_rank(self.rank) if latest.local is not None else None
        if local is not None:
            places.append(("local", local))
        for source, path in places:
            try:
                state = load_state(path, **kwargs)
                if state.step != latest.step:
                    raise ValueError(f"holds step {state.step}, not {latest.step}")
                return state, source, path
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                log.warning("%s copy %s unusable (%s)", source, path, exc)
        return None, "region", None
