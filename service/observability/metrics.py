"""In-process metrics of this agent, and the hooks the service calls.

Counters and histograms count what *this process* did (bytes it uploaded,
jobs it ran); Prometheus sums them over agents. What the catalog knows
(queues, replicas, recovery points) is computed at scrape time instead, see
``catalog``. Every family is prefixed ``tierckpt_``; see docs/API.md
("Metrics") for the list and deploy/prometheus/ for alert rules on them.

The hooks are one line at the call site and never raise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .context import current_job, job_elapsed

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

# Seconds: a small checkpoint uploads in well under a second, a large one in
# tens of minutes.
_TRANSFER_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
_HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

REGISTRATIONS = Counter(
    "tierckpt_registrations",
    "Checkpoint shards newly registered on this agent (a repeated identical "
    "registration is not counted).",
    ["priority"],
    registry=REGISTRY,
)
REGISTRATIONS_REFUSED_LATE = Counter(
    "tierckpt_registrations_refused_late",
    "Registrations answered from this agent's inbox that the catalog then "
    "refused (another agent registered the same rank with other content in "
    "between); each is logged with its reason.",
    registry=REGISTRY,
)
UPLOADED_BYTES = Counter(
    "tierckpt_uploaded_bytes",
    "Bytes uploaded from this node's local SSD into a region (repairs included).",
    ["region"],
    registry=REGISTRY,
)
DEDUP_BYTES = Counter(
    "tierckpt_dedup_bytes",
    "Bytes of checkpoint files not sent because an identical file (same SHA-256 "
    "and size) was already committed in the region: copied server-side instead. "
    "Not counted in tierckpt_uploaded_bytes.",
    ["region"],
    registry=REGISTRY,
)
UPLOAD_READ_BYTES = Counter(
    "tierckpt_upload_read_bytes",
    "Bytes of checkpoint files read from local SSD (or the memory tier) and hashed "
    "by uploads: once per file however many regions it is sent to at once.",
    registry=REGISTRY,
)
UPLOAD_SECONDS = Histogram(
    "tierckpt_upload_duration_seconds",
    "Time to upload one shard (read, hash and upload every file) into the primary region.",
    ["region"],
    buckets=_TRANSFER_BUCKETS,
    registry=REGISTRY,
)
REPLICATED_BYTES = Counter(
    "tierckpt_replicated_bytes",
    "Bytes copied into a region by replication or repair.",
    ["region"],
    registry=REGISTRY,
)
REPLICATION_SECONDS = Histogram(
    "tierckpt_replication_duration_seconds",
    "Time to copy one checkpoint into a region, manifest included.",
    ["region"],
    buckets=_TRANSFER_BUCKETS,
    registry=REGISTRY,
)
RESTORE_PLANNED_BYTES = Counter(
    "tierckpt_restore_planned_bytes",
    "Bytes of the restore plans handed out, by the preferred region (clients "
    "fetch S3 regions directly through presigned URLs).",
    ["region"],
    registry=REGISTRY,
)
SERVED_BYTES = Counter(
    "tierckpt_served_bytes",
    "Object bytes this agent streamed to restoring clients (POSIX regions).",
    ["region"],
    registry=REGISTRY,
)
SCRUB_RESULTS = Counter(
    "tierckpt_scrub_results",
    "Replica checks and repairs: result=verified (re-read, intact), corrupt "
    "(mismatch or missing object), repaired (a corrupt copy rewritten).",
    ["region", "result"],
    registry=REGISTRY,
)
JOB_RUNS = Counter(
    "tierckpt_job_runs",
    "Background job attempts on this agent by outcome: succeeded, retried "
    "(failed, will run again), failed (gave up), released (given back at shutdown).",
    ["kind", "outcome"],
    registry=REGISTRY,
)
JOB_SECONDS = Histogram(
    "tierckpt_job_duration_seconds",
    "Duration of successful background job attempts.",
    ["kind"],
    buckets=_TRANSFER_BUCKETS,
    registry=REGISTRY,
)
PEER_BYTES = Counter(
    "tierckpt_peer_bytes",
    "Bytes of peer copies: direction=pushed (sent by this agent to peers), "
    "received (accepted from peers, hash verified), served (read by restoring clients).",
    ["direction"],
    registry=REGISTRY,
)
PEER_CHECKS = Counter(
    "tierckpt_peer_checks",
    "Peer copy checks: where=push (a push refused on arrival: wrong hash or size), "
    "scrub (a re-read of a committed copy); result=verified or corrupt.",
    ["where", "result"],
    registry=REGISTRY,
)
REGISTER_PHASE_SECONDS = Histogram(
    "tierckpt_register_phase_seconds",
    "Where registrations spend their time in the agent: scan (listing the "
    "files), queued (behind an earlier batch of the group commit), gate and "
    "lock (waiting for the catalog: SQLite's write lock, a PostgreSQL "
    "connection), write (the statements), commit (the catalog's fsync); record "
    "(the catalog's read and the inbox record of a registration answered from "
    "the inbox, whose write follows).",
    ["phase"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
GAVE_WAY = Counter(
    "tierckpt_catalog_gave_way",
    "Background catalog transactions of the worker process rolled back before "
    "their next statement because a registration was waiting for SQLite's "
    "write lock, then run again.",
    registry=REGISTRY,
)
HTTP_REQUESTS = Counter(
    "tierckpt_http_requests",
    "HTTP requests answered, by route template and status code.",
    ["method", "route", "status"],
    registry=REGISTRY,
)
HTTP_SECONDS = Histogram(
    "tierckpt_http_request_duration_seconds",
    "HTTP request latency by route template.",
    ["method", "route"],
    buckets=_HTTP_BUCKETS,
    registry=REGISTRY,
)

_REGION_FAMILIES = (
    UPLOADED_BYTES,
    DEDUP_BYTES,
    UPLOAD_SECONDS,
    REPLICATED_BYTES,
    REPLICATION_SECONDS,
    RESTORE_PLANNED_BYTES,
    SERVED_BYTES,
)

# What the worker and the periodic passes count. When they run in the worker
# process (worker_process.py), that process reports these families to the
# agent (``worker_samples``) and ``/metrics`` adds them to the agent's own
# (``with_worker``): one agent, one set of series, as before.
_WORKER_FAMILIES = (
    GAVE_WAY,
    UPLOADED_BYTES,
    DEDUP_BYTES,
    UPLOAD_SECONDS,
    REPLICATED_BYTES,
    REPLICATION_SECONDS,
    SCRUB_RESULTS,
    JOB_RUNS,
    JOB_SECONDS,
    PEER_BYTES,
    PEER_CHECKS,
)

# One reported sample: family, sample name, labels, value.
WorkerSample = tuple[str, str, dict[str, str], float]


def worker_samples() -> list[WorkerSample]:
    """This process's values of the worker's families (``_created`` left out:
    a timestamp, not a count)."""
    out: list[WorkerSample] = []
    for family in _WORKER_FAMILIES:
        for metric in family.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_created"):
                    out.append((metric.name, sample.name, dict(sample.labels), sample.value))
    return out


class _WithWorker:
    """``REGISTRY`` with the worker process's reported values added in."""

    def __init__(self, samples: Iterable[Sequence[Any]]) -> None:
        self.extra: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for family, name, labels, value in samples:
            key = (str(name), tuple(sorted(dict(labels).items())))
            self.extra.setdefault(str(family), {})[key] = float(value)

    def collect(self) -> Iterator[Metric]:
        for metric in REGISTRY.collect():
            extra = dict(self.extra.get(metric.name, {}))
            if extra:
                samples = []
                for sample in metric.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key in extra:
                        sample = sample._replace(value=sample.value + extra.pop(key))
                    samples.append(sample)
                # Series only the worker process has (a job kind never run here).
                samples += [
                    Sample(name, dict(labels), value) for (name, labels), value in extra.items()
                ]
                metric.samples = samples
            yield metric


def with_worker(samples: Iterable[Sequence[Any]]) -> _WithWorker:
    """A collector for ``generate_latest``: this process's metrics plus a
    worker process's last report (``worker_samples`` there)."""
    return _WithWorker(samples)


def init_regions(regions: list[str]) -> None:
    """Create every region's series at zero, so rate() sees the first increment."""
    for region in regions:
        for family in _REGION_FAMILIES:
            family.labels(region)
        for result in ("verified", "corrupt", "repaired"):
            SCRUB_RESULTS.labels(region, result)


# -- hooks ---------------------------------------------------------------------


def observe_registration(priority: str) -> None:
    REGISTRATIONS.labels(priority).inc()


def count_registration_refused_late() -> None:
    REGISTRATIONS_REFUSED_LATE.inc()


def observe_register_phase(phase: str, seconds: float) -> None:
    REGISTER_PHASE_SECONDS.labels(phase).observe(seconds)


def observe_upload(region: str | None, nbytes: int, *, repair: bool = False) -> None:
    """A shard's files are in ``region``; the duration is the job's so far."""
    region = region or ""
    UPLOADED_BYTES.labels(region).inc(nbytes)
    UPLOAD_SECONDS.labels(region).observe(job_elapsed())
    if repair:
        SCRUB_RESULTS.labels(region, "repaired").inc()


def observe_upload_read(nbytes: int) -> None:
    """A file of ``nbytes`` was read and hashed once for the regions it went to."""
    UPLOAD_READ_BYTES.inc(nbytes)


def observe_dedup(region: str | None, nbytes: int) -> None:
    """``nbytes`` of a shard's files reached ``region`` by server-side copy of
    identical, already committed objects instead of being sent."""
    DEDUP_BYTES.labels(region or "").inc(nbytes)


def observe_replication(region: str | None, nbytes: int) -> None:
    """A checkpoint was copied into ``region`` (a repair when the job noted
    that the target copy was corrupt)."""
    region = region or ""
    REPLICATED_BYTES.labels(region).inc(nbytes)
    REPLICATION_SECONDS.labels(region).observe(job_elapsed())
    job = current_job()
    if job is not None and job.notes.get("repair"):
        SCRUB_RESULTS.labels(region, "repaired").inc()


def observe_verify(region: str | None, *, corrupt: bool) -> None:
    SCRUB_RESULTS.labels(region or "", "corrupt" if corrupt else "verified").inc()


def observe_peer_bytes(direction: str, nbytes: int) -> None:
    PEER_BYTES.labels(direction).inc(nbytes)


def observe_peer_corrupt(where: str) -> None:
    PEER_CHECKS.labels(where, "corrupt").inc()


def observe_peer_verified(where: str) -> None:
    PEER_CHECKS.labels(where, "verified").inc()


def observe_restore_plan(region: str, nbytes: int) -> None:
    RESTORE_PLANNED_BYTES.labels(region).inc(nbytes)


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def served_length(range_header: str | None, size: int) -> int:
    """Bytes a GET with this Range header returns from an object of ``size``."""
    if not range_header:
        return size
    match = _RANGE.match(range_header.strip())
    if match is None:  # several ranges or garbage: count the whole object
        return size
    first, last = match.groups()
    if not first:  # suffix range: the last N bytes
        return min(int(last or 0), size)
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    return max(0, end - start + 1)


def observe_served(region: str, range_header: str | None, size: int) -> None:
    SERVED_BYTES.labels(region).inc(served_length(range_header, size))


_OUTCOMES = {"release": "released", "retry": "retried", "fail": "failed"}


def observe_gave_way() -> None:
    GAVE_WAY.inc()


def observe_job(kind: str, outcome: str) -> None:
    """Called by the worker when an attempt ends: ``succeeded``, or how the
    worker settled it (``retry``, ``fail``, ``release``)."""
    outcome = _OUTCOMES.get(outcome, outcome)
    JOB_RUNS.labels(kind, outcome).inc()
    if outcome == "succeeded":
        JOB_SECONDS.labels(kind).observe(job_elapsed())


def observe_request(method: str, route: str, status: int, seconds: float) -> None:
    HTTP_REQUESTS.labels(method, route, str(status)).inc()
    HTTP_SECONDS.labels(method, route).observe(seconds)
