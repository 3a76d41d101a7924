"""``torch.distributed.checkpoint`` (DCP) through tierckpt.

Every rank writes its part into its own directory and registers it as its
rank; a restore brings all ranks' files back into one directory, where DCP
finds ``.metadata`` and every ``__R_0.distcp`` (hard-linked from this node's
T0 copies when it holds every rank's). Every call is collective;
:func:`save_distributed_async` returns once the state is staged in memory and
registers each rank's part when DCP has written it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._node import confirm_node, default_node
from ..errors import NotFoundError, TierckptError
from ..models import Checkpoint
from ..restore import safe_relpath
from ..sync_client import CheckpointClient
from .checkpoint_dir import RESTORE_PREFIX, STAGING_PREFIX

log = logging.getLogger("tierckpt.client.torch")


def _broadcast(value: Any, process_group: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=process_group)
    return box[0]


def save_distributed(
    client: CheckpointClient,
    run: str,
    step: int,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    metadata: Mapping[str, Any] | None = None,
    parent: int | None = None,
    priority: str = "normal",
    process_group: Any = None,
) -> Checkpoint | None:
    """Collective: every rank writes its part of ``state_dict`` with DCP's
    ``FileSystemWriter`` into ``root/run/step-N/rank-R`` and registers it as
    rank R of the world. Returns this rank's registration, or None when the
    step was registered before (a replayed step: left as it is).
    :func:`save_distributed_async` returns once the state is staged."""
    began = time.monotonic()
    target = _prepare(client, run, step, root, process_group)
    if target is None:
        return None
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(target.write_to)),
            process_group=process_group,
        )
    finally:
        target.clean()
    return target.register(client, time.monotonic() - began, metrics, metadata, parent, priority)


def save_distributed_async(
    client: CheckpointClient,
    run: str,
    step: int,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    metadata: Mapping[str, Any] | None = None,
    parent: int | None = None,
    priority: str = "normal",
    process_group: Any = None,
) -> PendingSave:
    """Collective, as :func:`save_distributed`, on DCP's ``async_save``: returns
    once ``state_dict`` is staged (copied into host memory), so training goes
    on while DCP writes the files; each rank registers its part as soon as its
    write completes (``write_seconds`` = the stall, not the write). Returns a
    :class:`PendingSave`; ``.result()`` waits for the write and the registration.

    The write runs collectives in a background thread: pass a process group
    of its own (``dist.new_group(backend="gloo")``), as DCP advises, so they
    never interleave with training's. A save on a group waits first for the
    previous one on that group (one write in flight per group, DCP's rule);
    that wait, if any, is part of the stall.
    """
    import torch.distributed.checkpoint as dcp

    began = time.monotonic()
    _wait_previous(process_group)
    target = _prepare(client, run, step, root, process_group)
    pending = PendingSave(run, step)
    if target is None:
        pending.settle(None, None, time.monotonic() - began)
        return pending
    try:
        future = dcp.async_save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(target.write_to)),
            process_group=process_group,
        )
    except BaseException:
        target.clean()
        raise
    stall = time.monotonic() - began
    if not isinstance(future, Future):  # AsyncSaveResponse (a stager that returns one)
        future = future.upload_completion
    _IN_FLIGHT[_group_key(process_group)] = pending

    def written(done: Future[Any]) -> None:
        # DCP's writer thread: register from here, so a trainer that never
        # calls result() still gets its checkpoint registered.
        target.clean()
        error = done.exception()
        if error is not None:
            log.error("%s step %d rank %d: DCP write failed: %s", run, step, target.rank, error)
            pending.settle(None, error, stall)
            return
        try:
            checkpoint = target.register(client, stall, metrics, metadata, parent, priority)
        except BaseException as exc:  # settle() must run: result() waits on it
            pending.settle(None, exc, stall)
            return
        pending.settle(checkpoint, None, stall)

    future.add_done_callback(written)
    return pending


class PendingSave:
    """An asynchronous DCP save of one rank: staged, being written, then registered."""

    def __init__(self, run: str, step: int) -> None:
        self.run, self.step = run, step
        self.stall_seconds: float | None = None
        self._done = threading.Event()
        self._checkpoint: Checkpoint | None = None
        self._error: BaseException | None = None

    def settle(
        self, checkpoint: Checkpoint | None, error: BaseException | None, stall: float
    ) -> None:
        self._checkpoint, self._error, self.stall_seconds = checkpoint, error, stall
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Checkpoint | None:
        """This rank's registration once the files are written and registered
        (None: the step was registered before, or registering failed and was
        logged); raises the write's error; TimeoutError after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.run} step {self.step} still being written")
        if self._error is not None and not isinstance(self._error, TierckptError):
            raise self._error
        return self._checkpoint


# One asynchronous write in flight per process group (the key: its object id,
# None for the default group).
_IN_FLIGHT: dict[int | None, PendingSave] = {}


def _group_key(process_group: Any) -> int | None:
    return None if process_group is None else id(process_group)


def _wait_previous(process_group: Any) -> None:
    previous = _IN_FLIGHT.pop(_group_key(process_group), None)
    if previous is not None and not previous.done():
        log.info("%s step %d still being written; waiting for it", previous.run, previous.step)
        previous._done.wait()


@dataclass
class _Target:
    """Where this rank writes a step, and whether it registers what it wrote."""

    run: str
    step: int
    rank: int
    world: int
    directory: Path
    scratch: Path | None  # set: this rank's part is registered already

    @property
    def write_to(self) -> Path:
        return self.scratch or self.directory

    def clean(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def register(
        self,
        client: CheckpointClient,
        stall: float,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        parent: int | None,
        priority: str,
    ) -> Checkpoint | None:
        if self.scratch is not None:
            return None
        try:
            return client.register(
                self.run,
                self.step,
                self.directory,
                rank=self.rank,
                world_size=self.world,
                metrics=metrics,
                metadata=metadata,
                parent=parent,
                priority=priority,
                write_seconds=stall,
            )
        except TierckptError as exc:
            log.warning(
                "%s step %d rank %d not registered: %s", self.run, self.step, self.rank, exc
            )
            return None


def _prepare(
    client: CheckpointClient,
    run: str,
    step: int,
    root: str | os.PathLike[str],
    process_group: Any,
) -> _Target | None:
    """Collective: where this rank writes ``step``; None when every rank's
    part is registered already (nothing to save)."""
    import torch.distributed as dist

    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    directory = Path(os.path.abspath(root)) / run / f"step-{step}" / f"rank-{rank:05d}"
    # A replayed step (resumed from an older checkpoint) may be registered
    # already, wholly or for some ranks. DCP's save is collective, so every
    # rank writes; a rank whose part is registered writes to a throwaway
    # directory and leaves its registered files alone.
    known: tuple[str | None, list[int]] = (None, [])
    if rank == 0:
        try:
            detail = client.get(run, step)
            known = (detail.state, [shard.rank for shard in detail.shards])
        except NotFoundError:
            pass
    state, registered_ranks = _broadcast(known, process_group)
    usable = state is not None and state not in ("failed", "deleted")
    if usable and len(set(registered_ranks)) == world:
        log.info("%s step %d is registered already (%s); not saved again", run, step, state)
        return None
    scratch = None
    if usable and rank in registered_ranks:
        directory.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}rank-{rank:05d}-", dir=directory.parent)
        )
    elif directory.exists():
        shutil.rmtree(directory)  # an unregistered leftover of an earlier life
    return _Target(run, step, rank, world, directory, scratch)


def latest_distributed(
    client: CheckpointClient, run: str, *, region: str | None = None, process_group: Any = None
) -> int | None:
    """Collective: the step of ``run``'s latest valid checkpoint as rank 0
    sees it, the same on every rank (None when there is none)."""
    import torch.distributed as dist

    step = None
    if dist.get_rank(process_group) == 0:
        latest = client.latest(run, region=region)
        step = latest.step if latest is not None else None
    found = _broadcast(step, process_group)
    return None if found is None else int(found)


@dataclass(frozen=True)
class DistributedRestored:
    """What one rank's :func:`restore_distributed_report` loaded, and from where."""

    step: int  # 0: nothing to restore
    source: str | None  # "local" (this node's T0 copies, linked), "region", None


def restore_distributed(
    client: CheckpointClient,
    run: str,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    region: str | None = None,
    process_group: Any = None,
) -> int:
    """Collective: load a DCP checkpoint of ``run`` (``step``, default the
    latest valid one, see :func:`latest_distributed`) into ``state_dict`` in
    place, as ``dcp.load`` does. Returns the step, 0 when there is none.

    Each rank needs every rank's files in one directory (what DCP reads).
    When this node holds every rank's T0 copy intact (a job whose ranks share
    a node, restarted there), they are hard-linked into a scratch directory
    next to them: no bytes move. Otherwise the rank downloads the whole
    checkpoint, verified. Either way the scratch directory goes afterwards.

    Build ``state_dict`` only once you know there is something to load:
    ``get_state_dict(model, optimizer)`` initialises a fresh optimizer's state
    by stepping it (with lr 0), which shifts Adam's step count of a fresh run.
    """
    return restore_distributed_report(
        client,
        run,
        state_dict,
        root,
        step=step,
        region=region,
        process_group=process_group,
    ).step


def restore_distributed_report(
    client: CheckpointClient,
    run: str,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    region: str | None = None,
    process_group: Any = None,
    node: str | None = None,
) -> DistributedRestored:
    """:func:`restore_distributed`, saying where this rank's files came from."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if step is None:
        step = latest_distributed(client, run, region=region, process_group=process_group)
        if step is None:
            return DistributedRestored(0, None)
    rank = dist.get_rank(process_group)
    run_dir = Path(os.path.abspath(root)) / run
    run_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{RESTORE_PREFIX}{step}-rank{rank}-", dir=run_dir))
    try:
        source = "local"
        node = node or default_node()
        confirm_node(client, node)
        files = _link_local_copies(client, run, step, region, node, scratch)
        if files is None:
            source = "region"
            files = client.restore(run, scratch / "ckpt", step=step, region=region)
        dcp.load(
            state_dict,
            storage_reader=dcp.FileSystemReader(str(files)),
            process_group=process_group,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DistributedRestored(int(step), source)


def _link_local_copies(
    client: CheckpointClient,
    run: str,
    step: int,
    region: str | None,
    node: str,
    scratch: Path,
) -> Path | None:
    """Every rank's files of ``step``, hard-linked from this node's intact T0
    copies into ``scratch/local``; None when this node does not hold them all
    (or one went meanwhile: evicted, replaced), and the caller downloads."""
    latest = client.latest(run, region=region, node=node)
    if latest is None or latest.step != step or latest.local is None:
        return None  # an older step is asked for: its copies are not checked here
    ranks = latest.local.ranks
    if any(r not in ranks for r in range(latest.world_size)):
        return None
    target = scratch / "local"
    target.mkdir()
    try:
        for entry in latest.files:
            relative = safe_relpath(entry.path)  # raises on a path out of the directory
            destination = target / relative
            if destination.exists():
                return None  # two ranks with one file name: not a DCP layout
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(Path(ranks[entry.rank]) / relative, destination)
    except OSError as exc:
        log.info("%s step %d: local copies not usable (%s); downloading", run, step, exc)
        return None
    return target
