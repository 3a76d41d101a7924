"""Prefetch jobs: bring a valid checkpoint into this node's T0 before a restart.

A prefetch job is bound to its node (``job.node``: only that node's agent
claims it) and writes the copy described in ``copies.py``, from the nearest
copy first: ranks whose own T0 copy is on this node and intact need nothing;
ranks an earlier prefetch left intact need nothing either (a second prefetch
reads no byte); every other file is streamed from the regions holding a
committed copy, the primary first, the next one when a region fails or
serves bytes that do not hash to the catalog (``fetch.py``). A file a killed
attempt already put in place is re-hashed locally, not fetched again. The
marker goes last, then T0 retention runs for the run and the job completes:
prefetched copies count in ``[local] keep_last`` like the node's own.

No catalog transaction is open during the I/O (write_gate.py): the plan is
read in one short read, the outcome recorded in one short transaction.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints.contents import load_contents
from ..concurrency import gather_or_cancel
from ..config import Settings
from ..db import reading, transaction
from ..jobs import queue
from ..jobs.worker import JobHandler, PermanentJobError
from ..models import VALID_STATES, Checkpoint, File, Job, JobKind, Replica, ReplicaState, Shard
from ..resources import Resources
from ..retention.service import evict_local_copies
from ..storage.base import StoreError
from ..storage.manifest import ObjectEntry
from . import copies
from .fetch import TMP_INFIX, BadCopy, fetch_object, hash_local

log = logging.getLogger("tierckpt.prefetch")


@dataclass(frozen=True)
class _Plan:
    checkpoint_id: int
    run_id: int
    run: str
    step: int
    world_size: int
    objects: list[ObjectEntry]
    shards: list[tuple[int, str | None, str]]  # rank, node, path
    files: list[tuple[int, str, int, int | None]]  # rank, path, size, mtime_ns
    sources: list[str]  # committed regions this agent can read, primary first


class PrefetchJobs:
    def __init__(self, resources: Resources) -> None:
        self.r = resources
        self.files = asyncio.Semaphore(resources.settings.upload.files_in_flight)

    def handlers(self) -> dict[str, JobHandler]:
        return {JobKind.PREFETCH: JobHandler(run=self.prefetch, on_failure=self.failed)}

    async def _plan(self, job: Job) -> _Plan:
        async with reading(self.r.sessionmaker)() as session:
            checkpoint = await session.get(Checkpoint, job.checkpoint_id)
            if checkpoint is None or checkpoint.state not in VALID_STATES:
                state = "gone" if checkpoint is None else checkpoint.state
                raise PermanentJobError(f"the checkpoint is no longer valid ({state})")
            if checkpoint.quarantined_at is not None:
                raise PermanentJobError("the checkpoint was quarantined")
            contents = await load_contents(session, checkpoint)
            shards = (
                await session.execute(
                    select(Shard.rank, Shard.node, Shard.path).where(
                        Shard.checkpoint_id == checkpoint.id
                    )
                )
            ).all()
            files = (
                await session.execute(
                    select(Shard.rank, File.path, File.size, File.mtime_ns)
                    .join(File, File.shard_id == Shard.id)
                    .where(Shard.checkpoint_id == checkpoint.id)
                )
            ).all()
            committed = await session.scalars(
                select(Replica.region).where(
                    Replica.checkpoint_id == checkpoint.id,
                    Replica.state == ReplicaState.COMMITTED,
                )
            )
            configured = [region.name for region in self.r.settings.regions]
            sources = sorted((r for r in committed if r in self.r.stores), key=configured.index)
            return _Plan(
                checkpoint_id=checkpoint.id,
                run_id=checkpoint.run_id,
                run=contents.run,
                step=checkpoint.step,
                world_size=checkpoint.world_size,
                objects=contents.objects,
                shards=[(s.rank, s.node, s.path) for s in shards],
                files=[(f.rank, f.path, f.size, f.mtime_ns) for f in files],
                sources=sources,
            )

    async def prefetch(self, job: Job) -> None:
        plan = await self._plan(job)
        settings = self.r.settings
        own = await asyncio.to_thread(
            copies.own_intact_ranks, settings.server.node, plan.shards, plan.files
        )
        needed = set(range(plan.world_size)) - own.keys()
        directory = copies.step_dir(settings, plan.run, plan.step)
        catalog = [(o.rank, o.path, o.size, o.sha256) for o in plan.objects]
        there = await asyncio.to_thread(copies.intact_ranks, directory, plan.checkpoint_id, catalog)
        fetched = 0
        if not needed <= there.keys():
            fetched = await self._copy(plan, directory, needed)
        # The new copy counts in [local] keep_last: older ones of the run go,
        # before the job says it is done (whoever waits on it then finds the
        # node's T0 as retention leaves it).
        await evict_local_copies(self.r, plan.run_id)
        async with transaction(self.r.sessionmaker) as session:
            await queue.complete(session, job)
        log.info(
            "prefetched %s:%d into T0 (%d byte(s) read from the regions)",
            plan.run,
            plan.step,
            fetched,
        )

    async def _copy(self, plan: _Plan, directory: Path, ranks: set[int]) -> int:
        """Put every file of ``ranks`` in ``directory``, verified, then the
        marker; the bytes read from the regions."""
        if not plan.sources:
            raise StoreError(f"no region holds a committed copy of {plan.run}:{plan.step}")
        objects = [o for o in plan.objects if o.rank in ranks]
        # The copy changes: not offered meanwhile.
        try:
            await asyncio.to_thread(_open_copy, self.r.settings, directory, sorted(ranks))
        except ValueError as exc:
            raise PermanentJobError(str(exc)) from exc
        read = 0
        done: list[copies.CopiedFile] = []

        async def one(obj: ObjectEntry) -> None:
            nonlocal read
            async with self.files:
                base = copies.rank_dir(directory, obj.rank)
                try:
                    target = await asyncio.to_thread(_target, base, obj.path)
                except ValueError as exc:
                    raise PermanentJobError(str(exc)) from exc
                if not await asyncio.to_thread(hash_local, target, obj.size, obj.sha256):
                    read += await self._fetch(plan, obj, target)
                info = await asyncio.to_thread(target.stat)
                done.append(
                    copies.CopiedFile(obj.rank, obj.path, obj.size, obj.sha256, info.st_mtime_ns)
                )

        await gather_or_cancel(*(one(o) for o in objects))
        marker = copies.Marker(
            plan.run, plan.step, plan.checkpoint_id, tuple(sorted(done, key=_order))
        )
        await asyncio.to_thread(copies.write_marker, directory, marker)
        return read

    async def _fetch(self, plan: _Plan, obj: ObjectEntry, target: Path) -> int:
        errors = []
        for region in plan.sources:
            try:
                return await fetch_object(self.r.stores[region], obj, target)
            except (BadCopy, StoreError) as exc:
                # A failure of this node's disk (OSError) is not the region's:
                # it propagates, and the job retries later.
                errors.append(f"{region}: {exc}")
                log.warning("prefetch of %s from %s failed: %s", obj.key, region, exc)
        raise StoreError(f"{obj.key}: every region failed: " + "; ".join(errors))

    async def failed(self, session: AsyncSession, job: Job, error: str) -> None:
        # The job row keeps the error (GET /v1/runs/{run}/prefetch shows it);
        # the checkpoint itself is untouched: a prefetch is only a copy.
        log.warning("prefetch job %d for node %s gave up: %s", job.id, job.node, error)


def _open_copy(settings: Settings, directory: Path, ranks: list[int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    copies.check_unlinked(settings, directory)
    (directory / copies.MARKER).unlink(missing_ok=True)
    # What an attempt killed mid-file left (one job at a time writes here).
    for parent, _dirs, names in os.walk(directory):
        for name in names:
            if TMP_INFIX in name:
                Path(parent, name).unlink(missing_ok=True)
    for rank in ranks:
        copies.rank_dir(directory, rank).mkdir(exist_ok=True)


def _target(base: Path, relative: str) -> Path:
    target = copies.confined(base, relative)
    target.parent.mkdir(parents=True, exist_ok=True)
    copies.confined(base, relative)  # no link planted by the mkdir's race
    return target


def _order(f: copies.CopiedFile) -> tuple[int, str]:
    return (f.rank, f.path)
