"""What the dashboard pages show: plain view objects, filled by service.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class RegionPoint:
    step: int
    created_at: datetime


@dataclass
class RunRow:
    name: str
    checkpoints: int
    latest_step: int | None
    last_registered: datetime | None
    regions: dict[str, RegionPoint] = field(default_factory=dict)
    pending: int = 0
    problems: int = 0

    @property
    def latest_valid(self) -> RegionPoint | None:
        """Where the run restarts from: the newest valid checkpoint in any region."""
        if not self.regions:
            return None
        return max(self.regions.values(), key=lambda p: (p.step, p.created_at))


@dataclass
class RegionHealth:
    name: str
    primary: bool
    pending: int = 0
    pending_bytes: int = 0
    oldest_wait: float = 0.0
    corrupt: int = 0


@dataclass
class Overview:
    now: datetime
    runs: list[RunRow]
    regions: list[RegionHealth]
    jobs: dict[tuple[str, str], int]  # (kind, state) -> count of active jobs
    retrying: int


@dataclass
class ReplicaView:
    region: str
    state: str
    lag: float | None
    error: str | None
    retrying: str | None = None  # the last error of a replicate job still retrying
    attempts: int = 0


@dataclass
class CheckpointView:
    step: int
    state: str
    created_at: datetime
    durable_at: datetime | None
    total_bytes: int
    file_count: int
    error: str | None
    parent: tuple[str, int] | None
    pinned: bool
    quarantined: bool
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    # "peer:<node>" -> that peer's state (peers/state.py), and peer-safe.
    peers: dict[str, str] = field(default_factory=dict)
    peer_safe: bool = False


@dataclass
class Failure:
    when: datetime
    step: int
    what: str  # "checkpoint", "replica", or the job kind
    region: str | None
    state: str
    attempts: int | None
    reason: str


@dataclass
class LineageNode:
    run: str
    step: int
    state: str | None
    created_at: datetime | None


@dataclass
class RegionLag:
    name: str
    primary: bool
    committed: int
    pending: int
    oldest_wait: float | None
    last_lag: float | None
    median_lag: float | None


@dataclass
class RunView:
    now: datetime
    name: str
    regions: list[str]
    total: int
    row: RunRow
    checkpoints: list[CheckpointView]  # newest step first
    failures: list[Failure]
    lags: list[RegionLag]
    lineage_nodes: list[LineageNode]
    lineage_edges: list[tuple[tuple[str, int], tuple[str, int]]]
