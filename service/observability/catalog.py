"""Gauges computed from the catalog at scrape time.

The catalog is the truth about queues, replicas and validity, and it is
shared by every agent: these gauges are the same whichever agent is scraped
(aggregate them with ``max``, not ``sum``). In-process counters are in
``metrics``.

The recovery point: ``tierckpt_last_durable_timestamp_seconds{run, region}``
is the registration time of the newest valid checkpoint committed in that
region, so ``time() - tierckpt_last_durable_timestamp_seconds`` is the
training time lost if the run died now and restarted from that region.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import replicas as replicas_repo
from ..checkpoints import repository as repo
from ..db import reading
from ..models import Checkpoint, Job, JobState, PeerCopy, ReplicaState, Run, utcnow
from ..peers import agents
from ..resources import Resources

log = logging.getLogger("tierckpt.metrics")

ACTIVE_JOB_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FAILED)


def epoch(value: datetime) -> float:
    """Catalog times are naive UTC."""
    return value.replace(tzinfo=UTC).timestamp()


async def _job_families(session: AsyncSession, now: datetime) -> list[Metric]:
    jobs = GaugeMetricFamily(
        "tierckpt_jobs",
        "Jobs in the catalog by kind, state (queued, running, failed) and region.",
        labels=["kind", "state", "region"],
    )
    retrying = GaugeMetricFamily(
        "tierckpt_jobs_retrying",
        "Queued jobs that already failed at least once (waiting for their backoff).",
        labels=["kind", "region"],
    )
    oldest = GaugeMetricFamily(
        "tierckpt_oldest_job_age_seconds",
        "Age of the oldest queued or running job by kind and region.",
        labels=["kind", "state", "region"],
    )
    rows = await session.execute(
        select(
            Job.kind,
            Job.state,
            Job.region,
            func.count(),
            func.sum(case((Job.attempts > 0, 1), else_=0)),
            func.min(Job.created_at),
        )
        .where(Job.state.in_(ACTIVE_JOB_STATES))
        .group_by(Job.kind, Job.state, Job.region)
    )
    for kind, state, region, count, tried, first in rows:
        labels = [kind, state, region or ""]
        jobs.add_metric(labels, count)
        if state == JobState.QUEUED:
            retrying.add_metric([kind, region or ""], tried or 0)
        if state != JobState.FAILED and first is not None:
            oldest.add_metric(labels, max(0.0, (now - first).total_seconds()))
    return [jobs, retrying, oldest]


async def _replica_families(
    session: AsyncSession, now: datetime, regions: list[str]
) -> list[Metric]:
    replicas = GaugeMetricFamily(
        "tierckpt_replicas",
        "Replicas of live (not failed, not deleted) checkpoints by region and state.",
        labels=["region", "state"],
    )
    pending_bytes = GaugeMetricFamily(
        "tierckpt_pending_bytes",
        "Bytes of live checkpoints not yet committed in the region (upload or replication due).",
        labels=["region"],
    )
    lag = GaugeMetricFamily(
        "tierckpt_replication_lag_seconds",
        "How long the oldest durable checkpoint has been waiting for its copy in "
        "the region (0: nothing waiting).",
        labels=["region"],
    )
    rows = await replicas_repo.totals(session)
    waiting: dict[str, float] = dict.fromkeys(regions, 0.0)
    pending: dict[str, float] = dict.fromkeys(regions, 0.0)
    for region, state, count, nbytes, first_durable in rows:
        replicas.add_metric([region, state], count)
        if state == ReplicaState.PENDING:
            pending[region] = float(nbytes or 0)
            if first_durable is not None:
                waiting[region] = max(0.0, (now - first_durable).total_seconds())
    for region, value in pending.items():
        pending_bytes.add_metric([region], value)
    for region, value in waiting.items():
        lag.add_metric([region], value)
    return [replicas, pending_bytes, lag]


async def _peer_families(session: AsyncSession, lease_seconds: float) -> list[Metric]:
    copies = GaugeMetricFamily(
        "tierckpt_peer_copies",
        "Peer copies of shards by the node holding them and state.",
        labels=["node", "state"],
    )
    for node, state, count in await session.execute(
        select(PeerCopy.node, PeerCopy.state, func.count()).group_by(PeerCopy.node, PeerCopy.state)
    ):
        copies.add_metric([node, state], count)
    live = GaugeMetricFamily(
        "tierckpt_agents_live",
        "Agents in the catalog whose heartbeat is within [peers] lease_seconds.",
    )
    live.add_metric([], len(await agents.live_agents(session, lease_seconds)))
    return [copies, live]


async def _checkpoint_families(session: AsyncSession, min_regions: int) -> list[Metric]:
    states = GaugeMetricFamily(
        "tierckpt_checkpoints", "Checkpoints in the catalog by state.", labels=["state"]
    )
    for state, count in await session.execute(
        select(Checkpoint.state, func.count()).group_by(Checkpoint.state)
    ):
        states.add_metric([state], count)

    durable_ts = GaugeMetricFamily(
        "tierckpt_last_durable_timestamp_seconds",
        "Registration time of the newest valid checkpoint committed in the region; "
        "time() minus it is the run's recovery point there.",
        labels=["run", "region"],
    )
    durable_step = GaugeMetricFamily(
        "tierckpt_last_durable_step",
        "Step of the newest valid checkpoint committed in the region.",
        labels=["run", "region"],
    )
    for run, region, checkpoint in await repo.last_durable_by_region(session, min_regions):
        durable_ts.add_metric([run, region], epoch(checkpoint.created_at))
        durable_step.add_metric([run, region], checkpoint.step)

    registered_ts = GaugeMetricFamily(
        "tierckpt_last_registered_timestamp_seconds",
        "When the run last registered a checkpoint (any state).",
        labels=["run"],
    )
    registered_step = GaugeMetricFamily(
        "tierckpt_last_registered_step",
        "Highest step the run registered (any state).",
        labels=["run"],
    )
    for run, newest, top in await session.execute(
        select(Run.name, func.max(Checkpoint.created_at), func.max(Checkpoint.step))
        .join(Checkpoint, Checkpoint.run_id == Run.id)
        .group_by(Run.name)
    ):
        registered_ts.add_metric([run], epoch(newest))
        registered_step.add_metric([run], top)
    return [states, durable_ts, durable_step, registered_ts, registered_step]


async def catalog_families(resources: Resources, busy_jobs: int) -> list[Metric]:
    """Every catalog gauge, plus ``tierckpt_catalog_up`` (0 when the catalog
    could not be read: the in-process metrics are still worth scraping) and
    this agent's ``busy_jobs`` (jobs its worker is running)."""
    settings = resources.settings
    started = time.monotonic()
    up = GaugeMetricFamily(
        "tierckpt_catalog_up", "1 when this scrape could read the catalog, else 0."
    )
    took = GaugeMetricFamily(
        "tierckpt_catalog_scrape_duration_seconds", "Time the catalog gauges took to compute."
    )
    families: list[Metric] = []
    try:
        async with reading(resources.sessionmaker)() as session:
            now = utcnow()
            families += await _job_families(session, now)
            families += await _replica_families(session, now, [r.name for r in settings.regions])
            families += await _checkpoint_families(session, settings.durability.min_regions)
            families += await _peer_families(session, settings.peers.lease_seconds)
        up.add_metric([], 1)
    except Exception as exc:
        log.warning("metrics: the catalog could not be read: %s", exc)
        families = []
        up.add_metric([], 0)
    took.add_metric([], time.monotonic() - started)

    info = GaugeMetricFamily(
        "tierckpt_agent_info", "This agent: its node name (value is always 1).", labels=["node"]
    )
    info.add_metric([settings.server.node], 1)
    busy = GaugeMetricFamily(
        "tierckpt_worker_busy_jobs", "Jobs this agent's worker is running right now."
    )
    busy.add_metric([], busy_jobs)
    return [*families, up, took, info, busy]


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def render(families: Iterable[Metric]) -> bytes:
    """Prometheus text exposition of already computed families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)
