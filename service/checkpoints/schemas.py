"""Request and response bodies of the checkpoint endpoints (docs/API.md)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from ..names import NAME_CHARS, RUN_PATTERN, not_a_dot_segment

MAX_STEP = 2**62
MAX_METADATA_BYTES = 64 * 1024
MAX_METRICS = 256


class StrictModel(BaseModel):
    # An unknown field is a typo the user wants to hear about.
    model_config = ConfigDict(extra="forbid")


class CheckpointRef(StrictModel):
    run: str = Field(pattern=RUN_PATTERN)
    step: int = Field(ge=0, le=MAX_STEP)

    _run_not_dots = field_validator("run")(not_a_dot_segment)


class ClientFileHash(StrictModel):
    path: str = Field(min_length=1, max_length=4096)
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")


class RegisterRequest(StrictModel):
    run: str = Field(pattern=RUN_PATTERN, description=NAME_CHARS)
    step: int = Field(ge=0, le=MAX_STEP)
    path: str = Field(min_length=1, max_length=4096)
    rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1, le=65536)
    epoch: int | None = Field(None, ge=0, le=MAX_STEP)
    metrics: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    parent: CheckpointRef | None = None
    files: list[ClientFileHash] | None = Field(None, max_length=100_000)
    priority: Literal["normal", "urgent"] = "normal"
    write_seconds: float | None = Field(None, ge=0, le=86400 * 30)

    _run_not_dots = field_validator("run")(not_a_dot_segment)

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, metrics: dict[str, float]) -> dict[str, float]:
        if len(metrics) > MAX_METRICS:
            raise ValueError(f"at most {MAX_METRICS} metrics")
        for name, value in metrics.items():
            if not name or len(name) > 128:
                raise ValueError("metric names must be 1-128 characters")
            if not math.isfinite(value):
                raise ValueError(f"metric {name!r} must be a finite number")
        return metrics

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata must serialise to at most {MAX_METADATA_BYTES} bytes")
        return metadata

    @model_validator(mode="after")
    def _rank_in_world(self) -> RegisterRequest:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be below world_size {self.world_size}")
        return self


def iso_timestamp(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is not None:  # parsed back from our own output
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.isoformat(timespec="milliseconds") + "Z"


class FileOut(BaseModel):
    rank: int
    path: str
    size: int
    sha256: str | None


class ShardOut(BaseModel):
    rank: int
    node: str
    path: str
    state: str
    error: str | None


class ReplicaOut(BaseModel):
    region: str
    state: str
    uri: str
    verified_at: datetime | None
    committed_at: datetime | None
    error: str | None
    # Replication lag behind the first durable copy: how long it took, or
    # (still pending) how long it has been waiting.
    lag_seconds: float | None = None

    @field_serializer("verified_at", "committed_at")
    def _ts(self, value: datetime | None) -> str | None:
        return iso_timestamp(value)


class JobOut(BaseModel):
    kind: str
    state: str
    region: str | None
    rank: int | None
    attempts: int
    last_error: str | None


class RefOut(BaseModel):
    run: str
    step: int


class PeerOut(BaseModel):
    """The checkpoint's copy on one peer node (peers/state.py gives the rule)."""

    name: str  # "peer:<node>"
    node: str
    state: str
    shards: int  # shards of the checkpoint sent to that node
    committed: int  # of those, committed (hash verified on arrival)
    committed_at: datetime | None
    verified_at: datetime | None

    @field_serializer("verified_at", "committed_at")
    def _ts(self, value: datetime | None) -> str | None:
        return iso_timestamp(value)


class CopyOut(BaseModel):
    tier: Literal["memory", "t0", "peer", "region"]
    node: str | None = None
    rank: int | None = None
    path: str | None = None
    region: str | None = None
    uri: str | None = None


class CheckpointOut(BaseModel):
    run: str
    step: int
    state: str
    world_size: int
    epoch: int | None
    priority: str
    metrics: dict[str, float]
    metadata: dict[str, Any]
    parent: RefOut | None
    children: list[RefOut]
    created_at: datetime
    durable_at: datetime | None
    error: str | None
    total_bytes: int
    file_count: int
    write_seconds: float | None
    pinned: bool = False
    quarantined_at: datetime | None = None
    quarantine_reason: str | None = None
    deleted_at: datetime | None = None
    deleted_reason: str | None = None
    shards: list[ShardOut]
    files: list[FileOut] | None = None
    replicas: list[ReplicaOut]
    # Background work on this checkpoint (detail view only): what is queued,
    # running or failed, with attempts and the last error.
    jobs: list[JobOut] | None = None
    # Detail view only: where the bytes are (memory, T0, peers, regions).
    copies: list[CopyOut] | None = None
    # Detail view only: the copies on peer nodes ([peers] copies), and
    # whether every shard has its [peers] copies committed on other nodes.
    peers: list[PeerOut] | None = None
    peer_safe: bool | None = None

    @field_serializer("created_at", "durable_at", "quarantined_at", "deleted_at")
    def _ts(self, value: datetime | None) -> str | None:
        return iso_timestamp(value)


class LocationOut(BaseModel):
    region: str
    uri: str


class LocalCopyOut(BaseModel):
    node: str
    path: str | None = Field(
        description="rank 0's T0 copy on this node (the whole checkpoint when world_size is 1)"
    )
    ranks: dict[int, str] = Field(
        default_factory=dict,
        description="every rank whose T0 copy on this node is intact: rank -> its directory",
    )


class LatestOut(CheckpointOut):
    locations: list[LocationOut]
    local: LocalCopyOut | None


class CheckpointPage(BaseModel):
    checkpoints: list[CheckpointOut]
    total: int


class PlanFile(BaseModel):
    rank: int
    path: str
    size: int
    sha256: str
    url: str
    # With ?chunks=true, when the catalog has them (storage/chunks.py): the
    # SHA-256 of every chunk_size chunk, so a reader verifies byte ranges.
    chunk_size: int | None = None
    chunk_sha256: list[str] | None = None


class PlanSource(BaseModel):
    # A region's name, or "peer:<node>[+<node>...]" for peer copies.
    region: str
    files: list[PlanFile]
    # "peer": the URLs are other agents' (absolute), read with the caller's token.
    tier: Literal["region", "peer"] = "region"


class RestorePlan(BaseModel):
    run: str
    step: int
    world_size: int
    sources: list[PlanSource]


class QuarantineRequest(StrictModel):
    reason: str = Field(min_length=1, max_length=4000)


class LineageNode(BaseModel):
    run: str
    step: int
    state: str | None  # None: the parent is not in this catalog
    created_at: datetime | None = None
    metrics: dict[str, float] = Field(default_factory=dict)

    @field_serializer("created_at")
    def _ts(self, value: datetime | None) -> str | None:
        return iso_timestamp(value)


class LineageOut(BaseModel):
    checkpoint: LineageNode
    ancestors: list[LineageNode]  # parent first, then its parent, ...
    children: list[LineageNode]
