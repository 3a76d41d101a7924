"""The dashboard's views: runs and their recovery point, one run's timeline,
replication lag, failures and lineage, assembled from the catalog (read-only)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas
from ..checkpoints import repository as repo
from ..checkpoints.replicas import LIVE
from ..checkpoints.state import replication_lag
from ..config import Settings
from ..models import Checkpoint, CheckpointState, Job, ReplicaState, Run, utcnow
from ..peers.repository import copies_of
from ..peers.state import by_node, peer_safe
from . import repository as queries
from .repository import ACTIVE_JOBS
from .views import (
    CheckpointView,
    Failure,
    LineageNode,
    Overview,
    RegionHealth,
    RegionLag,
    RegionPoint,
    ReplicaView,
    RunRow,
    RunView,
)

TIMELINE_LIMIT = 200
FAILURE_LIMIT = 50


async def _run_rows(
    session: AsyncSession,
    settings: Settings,
    runs: list[Run],
    counts: dict[int, tuple[int, int | None]],
) -> list[RunRow]:
    ids = [run.id for run in runs]
    by_id = {run.id: run for run in runs}
    rows: dict[int, RunRow] = {}
    newest = await queries.newest_registration(session, ids)
    for run in runs:
        count, top = counts.get(run.id, (0, None))
        rows[run.id] = RunRow(run.name, count, top, newest.get(run.id))
    name_to_id = {run.name: run.id for run in by_id.values()}
    for name, region, checkpoint in await repo.last_durable_by_region(
        session, settings.durability.min_regions, ids
    ):
        rows[name_to_id[name]].regions[region] = RegionPoint(checkpoint.step, checkpoint.created_at)
    for run_id, pending in await queries.pending_replicas(session, ids):
        rows[run_id].pending = pending
    for run_id, problems in await queries.failed_checkpoints(session, ids):
        rows[run_id].problems += problems
    for run_id, retrying in await queries.retrying_jobs(session, ids):
        rows[run_id].problems += retrying
    return [rows[run.id] for run in runs]


async def overview(
    session: AsyncSession, settings: Settings, visible: Callable[[str], bool]
) -> Overview:
    """Every run the caller may read (``visible(run)``), with its recovery
    point per region, and the health of each region."""
    now = utcnow()
    listed, _total = await repo.list_runs(session, 10_000, 0)
    runs = [run for run, _c, _t in listed if visible(run.name)]
    counts = {run.id: (count, top) for run, count, top in listed}
    rows = await _run_rows(session, settings, runs, counts)

    names = [region.name for region in settings.regions]
    health = {name: RegionHealth(name, i == 0) for i, name in enumerate(names)}
    for region, state, count, nbytes, first in await replicas.totals(session):
        entry = health.setdefault(region, RegionHealth(region, False))
        if state == ReplicaState.PENDING:
            entry.pending, entry.pending_bytes = count, int(nbytes or 0)
            if first is not None:
                entry.oldest_wait = (now - first).total_seconds()
        elif state == ReplicaState.CORRUPT:
            entry.corrupt = count
    jobs: dict[tuple[str, str], int] = {}
    retrying = 0
    for kind, state, count, failing in await queries.active_job_counts(session):
        jobs[(kind, state)] = count
        retrying += failing
    return Overview(now, rows, list(health.values()), jobs, retrying)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


async def run_view(session: AsyncSession, settings: Settings, run: Run) -> RunView:
    now = utcnow()
    regions = [region.name for region in settings.regions]
    page, total = await repo.list_checkpoints(
        session,
        run.id,
        states=None,
        min_step=None,
        max_step=None,
        limit=TIMELINE_LIMIT,
        offset=0,
    )
    ids = [c.id for c in page]
    peer_copies = defaultdict(list)
    for copy in await copies_of(session, ids):
        peer_copies[copy.checkpoint_id].append(copy)
    shard_nodes: dict[int, dict[int, str]] = defaultdict(dict)
    if peer_copies:
        for shard in await repo.shards_of(session, list(peer_copies)):
            shard_nodes[shard.checkpoint_id][shard.id] = shard.node
    replicas = defaultdict(list)
    for replica in await repo.replicas_of(session, ids):
        replicas[replica.checkpoint_id].append(replica)
        if replica.region not in regions:
            regions.append(replica.region)
    # Replicate jobs still retrying: why a pending copy is not there yet.
    retrying: dict[tuple[int, str], Job] = {}
    failures: list[Failure] = []
    step_of = {c.id: c.step for c in page}
    job_rows = await queries.failing_jobs(session, run.id, FAILURE_LIMIT)
    for job in job_rows:
        if job.region is not None and job.state in ACTIVE_JOBS:
            retrying.setdefault((job.checkpoint_id, job.region), job)
        step = step_of.get(job.checkpoint_id)
        if step is None:
            step = await queries.step_of(session, job.checkpoint_id)
        state = "retrying" if job.state in ACTIVE_JOBS else job.state
        failures.append(
            Failure(
                job.updated_at,
                step or 0,
                job.kind,
                job.region,
                state,
                job.attempts,
                job.last_error or "",
            )
        )

    views: list[CheckpointView] = []
    for c in page:
        view = CheckpointView(
            step=c.step,
            state=c.state,
            created_at=c.created_at,
            durable_at=c.durable_at,
            total_bytes=c.total_bytes,
            file_count=c.file_count,
            error=c.error,
            parent=(c.parent_run, c.parent_step)
            if c.parent_run is not None and c.parent_step is not None
            else None,
            pinned=c.pinned,
            quarantined=c.quarantined_at is not None,
            peers={f"peer:{p.node}": p.state for p in by_node(peer_copies[c.id])},
            peer_safe=peer_safe(
                c.world_size, shard_nodes[c.id], peer_copies[c.id], settings.peers.copies
            ),
        )
        for r in replicas[c.id]:
            retry = retrying.get((c.id, r.region))
            view.replicas[r.region] = ReplicaView(
                region=r.region,
                state=r.state,
                lag=replication_lag(c, r),
                error=r.error,
                retrying=retry.last_error if retry is not None else None,
                attempts=retry.attempts if retry is not None else 0,
            )
            if r.error and c.state != CheckpointState.DELETED:
                failures.append(
                    Failure(c.updated_at, c.step, "replica", r.region, r.state, None, r.error)
                )
        if c.state in (CheckpointState.FAILED, CheckpointState.CORRUPT) and c.error:
            failures.append(
                Failure(c.updated_at, c.step, "checkpoint", None, c.state, None, c.error)
            )
        views.append(view)
    failures.sort(key=lambda f: f.when, reverse=True)

    lags = []
    for i, name in enumerate(regions):
        live = [v for v in views if v.state in LIVE and name in v.replicas]
        committed = [v.replicas[name] for v in live if v.replicas[name].state == "committed"]
        pending = [v.replicas[name] for v in live if v.replicas[name].state == "pending"]
        done = [r.lag for r in committed if r.lag is not None]
        waits = [r.lag for r in pending if r.lag is not None]
        lags.append(
            RegionLag(
                name=name,
                primary=i == 0,
                committed=len(committed),
                pending=len(pending),
                oldest_wait=max(waits) if waits else None,
                last_lag=done[0] if done else None,
                median_lag=_median(done[:20]),
            )
        )

    counts = {run.id: (total, page[0].step if page else None)}
    (row,) = await _run_rows(session, settings, [run], counts)
    nodes, edges = await _lineage(session, run, page)
    return RunView(
        now=now,
        name=run.name,
        regions=regions,
        total=total,
        row=row,
        checkpoints=views,
        failures=failures[:FAILURE_LIMIT],
        lags=lags,
        lineage_nodes=nodes,
        lineage_edges=edges,
    )


LINEAGE_LIMIT = 40


async def _lineage(
    session: AsyncSession, run: Run, page: list[Checkpoint]
) -> tuple[list[LineageNode], list[tuple[tuple[str, int], tuple[str, int]]]]:
    """The newest checkpoints of the run, their parents (in any run) and the
    checkpoints of other runs forked from them."""
    shown = page[:LINEAGE_LIMIT]
    nodes: dict[tuple[str, int], LineageNode] = {
        (run.name, c.step): LineageNode(run.name, c.step, c.state, c.created_at) for c in shown
    }
    edges: list[tuple[tuple[str, int], tuple[str, int]]] = []
    for c in shown:
        if c.parent_run is None or c.parent_step is None:
            continue
        parent = (c.parent_run, c.parent_step)
        if parent not in nodes and parent[0] != run.name:
            found = None
            parent_run = await repo.find_run(session, parent[0])
            if parent_run is not None:
                found = await repo.find_checkpoint(session, parent_run.id, parent[1])
            nodes[parent] = LineageNode(
                parent[0],
                parent[1],
                found.state if found else None,
                found.created_at if found else None,
            )
        if parent in nodes:
            edges.append((parent, (run.name, c.step)))
    steps = [c.step for c in shown]
    if steps:
        for name, child in await queries.forks(session, run, steps, LINEAGE_LIMIT):
            key = (name, child.step)
            nodes[key] = LineageNode(name, child.step, child.state, child.created_at)
            edges.append(((run.name, child.parent_step or 0), key))
    return list(nodes.values()), edges


async def run_view_named(session: AsyncSession, settings: Settings, name: str) -> RunView | None:
    """The run's page, or None: the run has no checkpoints."""
    run = await repo.find_run(session, name)
    return None if run is None else await run_view(session, settings, run)
