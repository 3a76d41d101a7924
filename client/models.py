"""Pydantic mirrors of the JSON objects in docs/API.md.

Unknown fields are ignored and most fields are optional, so the service can
grow its answers without breaking clients already deployed on trainers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# "Wait until at least" order; anything else is either a terminal failure or a
# state this client version does not know yet (treated as not reached).
STATE_ORDER = ("staged", "registered", "uploading", "durable", "replicated")
FAILED_STATES = frozenset({"failed", "corrupt", "deleted"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _null_as_empty(value: Any, empty: Any) -> Any:
    return empty if value is None else value


class CheckpointRef(_Model):
    run: str
    step: int

    def __str__(self) -> str:
        return f"{self.run}:{self.step}"


class FileEntry(_Model):
    rank: int = 0
    path: str
    size: int
    sha256: str | None = None


class Shard(_Model):
    rank: int
    node: str | None = None
    path: str | None = None
    state: str
    error: str | None = None


class Replica(_Model):
    region: str
    state: str
    uri: str | None = None
    verified_at: datetime | None = None
    committed_at: datetime | None = None
    error: str | None = None
    lag_seconds: float | None = None


class Job(_Model):
    """Background work on a checkpoint (detail view only)."""

    kind: str
    state: str
    region: str | None = None
    rank: int | None = None
    attempts: int = 0
    last_error: str | None = None

    @property
    def active(self) -> bool:
        return self.state in ("queued", "running")


class Location(_Model):
    region: str
    uri: str | None = None


class LocalCopy(_Model):
    """The T0 copies of a checkpoint on the asking node (``latest(node=…)``)."""

    node: str
    path: str | None = None  # rank 0's directory (the checkpoint, when world_size is 1)
    ranks: dict[int, str] = {}  # every intact rank on this node -> its directory

    def of_rank(self, rank: int) -> str | None:
        """Rank ``rank``'s intact copy on this node (an agent older than
        ``ranks`` names only a whole single-rank checkpoint's, as ``path``)."""
        if self.ranks:
            return self.ranks.get(rank)
        return self.path if rank == 0 else None


class PeerCopy(_Model):
    """The checkpoint's copy on one peer node (detail view): ``name`` is
    ``peer:<node>``; ``state`` committed once that node holds, verified,
    every shard it was sent."""

    name: str
    node: str
    state: str
    shards: int = 0
    committed: int = 0
    committed_at: datetime | None = None
    verified_at: datetime | None = None


class Copy(_Model):
    """Where a copy of the checkpoint is (detail view): ``memory`` (an agent's
    arena), ``t0`` (a node's local SSD), ``peer`` (a shard's copy on another
    node's T0) or ``region``."""

    tier: str
    node: str | None = None
    rank: int | None = None
    path: str | None = None
    region: str | None = None
    uri: str | None = None


class MemoryCopy(_Model):
    """A rank's files in the asking node's memory tier (``latest`` with scope=node)."""

    node: str
    rank: int = 0
    path: str


class MemorySegment(_Model):
    """Room reserved in the agent's memory tier: write the files into ``path``."""

    id: str
    path: str
    bytes: int
    # When the agent reclaims it if it is not registered (UTC).
    expires_at: datetime | None = None
    # A file to keep locked while holding it: the agent frees the segment
    # once that lock is dropped (client/torch/segment_holds.py).
    holder: str | None = None


class MemoryInfo(_Model):
    enabled: bool = False
    node: str | None = None
    bytes: int = 0
    used: int = 0
    when_full: str = "disk"
    wait_seconds: float = 0.0
    keep_newest: bool = True
    # Whether the agent reserves a save's next segment when staging it.
    reserve_next: bool = False


class Checkpoint(_Model):
    run: str
    step: int
    state: str
    world_size: int = 1
    epoch: int | None = None
    priority: str = "normal"
    metrics: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    parent: CheckpointRef | None = None
    children: list[CheckpointRef] = Field(default_factory=list)
    created_at: datetime | None = None
    durable_at: datetime | None = None
    error: str | None = None
    total_bytes: int | None = None
    file_count: int | None = None
    write_seconds: float | None = None
    shards: list[Shard] = Field(default_factory=list)
    files: list[FileEntry] = Field(default_factory=list)
    replicas: list[Replica] = Field(default_factory=list)
    # Only in the detail view (GET one checkpoint).
    jobs: list[Job] = Field(default_factory=list)
    # Only in the answer of `latest`.
    locations: list[Location] = Field(default_factory=list)
    local: LocalCopy | None = None
    # Only in the detail view: where the bytes are.
    copies: list[Copy] = Field(default_factory=list)
    # Only in the detail view: the copies on peer nodes, and whether every
    # shard has its [peers] copies (None: not in this answer).
    peers: list[PeerCopy] = Field(default_factory=list)
    peer_safe: bool | None = None
    # Only in the answer of `latest` with scope="node".
    durable_step: int | None = None
    memory: list[MemoryCopy] = Field(default_factory=list)
    # Only in the answer of `register_segment(..., reserve_next=True)`: the
    # segment reserved for the run's next save (None: no room for it now).
    next_segment: MemorySegment | None = None

    @field_validator("metrics", "metadata", mode="before")
    @classmethod
    def _dict_or_empty(cls, value: Any) -> Any:
        return _null_as_empty(value, {})

    @field_validator(
        "children",
        "shards",
        "files",
        "replicas",
        "jobs",
        "locations",
        "copies",
        "peers",
        "memory",
        mode="before",
    )
    @classmethod
    def _list_or_empty(cls, value: Any) -> Any:
        return _null_as_empty(value, [])

    @property
    def verifying(self) -> bool:
        return any(j.kind == "verify" and j.active for j in self.jobs)

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(run=self.run, step=self.step)


class RunRegion(_Model):
    """The newest valid checkpoint of a run committed in one region."""

    region: str
    step: int
    created_at: datetime | None = None


class RunSummary(_Model):
    run: str
    checkpoints: int = 0
    latest_step: int | None = None
    created_at: datetime | None = None
    regions: list[RunRegion] = Field(default_factory=list)

    @field_validator("regions", mode="before")
    @classmethod
    def _regions(cls, value: Any) -> Any:
        return _null_as_empty(value, [])


class PlanFile(_Model):
    rank: int = 0
    path: str
    size: int = Field(ge=0)
    sha256: str | None = None
    url: str
    # Asked for with chunks=True; None for files uploaded before chunk hashes.
    chunk_size: int | None = None
    chunk_sha256: list[str] | None = None


class RestoreSource(_Model):
    # A region, or "peer:<node>[+<node>...]": copies on other agents.
    region: str
    files: list[PlanFile] = Field(default_factory=list)
    # "peer": the URLs are other agents' and are read with the client's token.
    tier: str = "region"


class RestorePlan(_Model):
    """Answer of ``GET …/checkpoints/{step}/download``: the sources holding
    a committed copy, nearest first (peer agents, then regions)."""

    run: str
    step: int
    world_size: int = 1
    sources: list[RestoreSource] = Field(default_factory=list)


class LineageNode(_Model):
    run: str
    step: int
    state: str | None = None  # None: the parent is not in this catalog
    created_at: datetime | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


class Lineage(_Model):
    checkpoint: LineageNode
    ancestors: list[LineageNode] = Field(default_factory=list)  # parent first
    children: list[LineageNode] = Field(default_factory=list)


class AdviceSample(_Model):
    median_seconds: float | None = None
    samples: int = 0


class AdviceObserved(_Model):
    checkpoints: int = 0
    write_seconds: AdviceSample = Field(default_factory=AdviceSample)
    upload_seconds: AdviceSample = Field(default_factory=AdviceSample)
    interval_seconds: AdviceSample = Field(default_factory=AdviceSample)
    compute_seconds: AdviceSample = Field(default_factory=AdviceSample)
    steps_per_second: float | None = None


class AdviceInterval(_Model):
    interval_seconds: float
    interval_hours: float
    every_steps: int | None = None
    waste_fraction: float


class AdviceScenario(_Model):
    """One checkpoint cost (``write``, ``upload`` or ``override``) and the
    intervals it leads to; ``current`` is the run's observed interval."""

    basis: str
    description: str = ""
    cost_seconds: float
    young: AdviceInterval
    daly: AdviceInterval
    current: AdviceInterval | None = None


class Advice(_Model):
    """Answer of ``GET /v1/runs/{run}/advice``."""

    run: str
    mtbf_hours: float
    restart_seconds: float = 0.0
    window: int = 0
    observed: AdviceObserved = Field(default_factory=AdviceObserved)
    scenarios: list[AdviceScenario] = Field(default_factory=list)


class PrefetchJob(_Model):
    """One node's prefetch of a checkpoint into its T0 (``POST
    /v1/runs/{run}/prefetch``): queued, running, succeeded or failed
    (``error`` says why; a queued job with an error waits to retry)."""

    id: int
    run: str
    step: int
    node: str
    state: str
    attempts: int = 0
    error: str | None = None
    created_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed")


class Prefetch(_Model):
    """The checkpoint being prefetched and its job on each node asked for."""

    run: str
    step: int
    jobs: list[PrefetchJob] = Field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(job.done for job in self.jobs)

    @property
    def failed(self) -> list[PrefetchJob]:
        return [job for job in self.jobs if job.state == "failed"]
