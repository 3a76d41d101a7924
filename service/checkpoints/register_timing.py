"""Where a registration's time goes, for its request's log line and metrics.

A registration waits in the agent in a few places that nothing else shows
apart: the scan of its files, the queue of the group commit (batching.py)
while an earlier batch commits, the catalog (SQLite: the in-process write
gate, then the database's write lock that a background transaction or the
worker process may hold; PostgreSQL: a pooled connection), its statements,
the commit, and on SQLite the fsync of the WAL after it (wal_sync.py). When register latency
grows under upload load, these say which of them grew. The benchmark reads
them from the request log (benchmarks/scenarios/register_latency.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..observability import metrics
from ..observability.context import note_request

# The writer's phases, in the order a batch goes through them.
PHASES = ("gate", "lock", "write", "commit", "sync")


@dataclass
class Phases:
    """Seconds spent by one batch in each phase (summed over its attempts:
    a batch written again after a race, or one by one after a refusal)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass(frozen=True)
class BatchTiming:
    """One registration's time in the writer: queued until its batch began,
    then its batch's phases."""

    queued: float
    phases: dict[str, float]
    size: int

    @classmethod
    def of(cls, phases: Phases, *, queued: float, size: int) -> BatchTiming:
        return cls(queued=queued, phases=dict(phases.seconds), size=size)


def report_recorded(scan_seconds: float, total_seconds: float) -> None:
    """A registration answered from the inbox (inbox.py): its scan, then the
    catalog's read and the record written (``record``)."""
    record = max(0.0, total_seconds - scan_seconds)
    note_request(register_scan_ms=_ms(scan_seconds), register_record_ms=_ms(record))
    metrics.observe_register_phase("scan", scan_seconds)
    metrics.observe_register_phase("record", record)


def report(scan_seconds: float, timing: BatchTiming | None) -> None:
    """Log the phases with the request and observe them in the metrics."""
    facts: dict[str, Any] = {"register_scan_ms": _ms(scan_seconds)}
    metrics.observe_register_phase("scan", scan_seconds)
    if timing is not None:
        facts["register_queued_ms"] = _ms(timing.queued)
        facts["register_batch"] = timing.size
        metrics.observe_register_phase("queued", timing.queued)
        for phase in PHASES:
            if phase in timing.phases:
                facts[f"register_{phase}_ms"] = _ms(timing.phases[phase])
                metrics.observe_register_phase(phase, timing.phases[phase])
    note_request(**facts)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
