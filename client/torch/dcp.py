"""``torch.distributed.checkpoint`` (DCP) through tierckpt.

Every rank writes its part into its own directory and registers it as its
rank; a restore brings all ranks' files back into one directory, where DCP
finds ``.metadata`` and every ``__R_0.distcp``. All three calls are
collective.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import NotFoundError, TierckptError
from ..models import Checkpoint
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
    step was registered before (a replayed step: left as it is)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    directory = Path(os.path.abspath(root)) / run / f"step-{step}" / f"rank-{rank:05d}"
    # A replayed step (resumed from an older checkpoint) may be registered
    # already, wholly or for some ranks. dcp.save is collective, so every rank
    # writes; a rank whose part is registered writes to a throwaway directory
    # and leaves its registered files alone.
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
    mine = usable and rank in registered_ranks
    began = time.monotonic()
    scratch = None
    if mine:
        directory.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}rank-{rank:05d}-", dir=directory.parent)
        )
    elif directory.exists():
        shutil.rmtree(directory)  # an unregistered leftover of an earlier life
    try:
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(scratch or directory)),
            process_group=process_group,
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if mine:
        return None
    written = time.monotonic() - began
    try:
        return client.register(
            run,
            step,
            directory,
            rank=rank,
            world_size=world,
            metrics=metrics,
            metadata=metadata,
            parent=parent,
            priority=priority,
            write_seconds=written,
        )
    except TierckptError as exc:
        log.warning("%s step %d rank %d not registered: %s", run, step, rank, exc)
        return None


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
    place, as ``dcp.load`` does. Every rank downloads the whole checkpoint
    (all ranks' files in one directory, which is what DCP reads) next to its
    data, loads it and removes the download. Returns the step, 0 when there
    is none.

    Build ``state_dict`` only once you know there is something to load:
    ``get_state_dict(model, optimizer)`` initialises a fresh optimizer's state
    by stepping it (with lr 0), which shifts Adam's step count of a fresh run.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if step is None:
        step = latest_distributed(client, run, region=region, process_group=process_group)
        if step is None:
            return 0
    rank = dist.get_rank(process_group)
    run_dir = Path(os.path.abspath(root)) / run
    run_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{RESTORE_PREFIX}{step}-rank{rank}-", dir=run_dir))
    try:
        restored = client.restore(run, scratch / "ckpt", step=step, region=region)
        dcp.load(
            state_dict,
            storage_reader=dcp.FileSystemReader(str(restored)),
            process_group=process_group,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return int(step)
