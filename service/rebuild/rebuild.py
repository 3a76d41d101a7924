"""Rebuild a lost catalog from the regions' manifests (DESIGN.md "Object layout").

Every region holds, per checkpoint, ``{run}/step-{step:012d}/MANIFEST.json``
(written last: the commit marker) listing world_size, parent, metrics and
every file with its size and SHA-256. From those alone the catalog is
recreated, and **nothing is called valid before its bytes are re-read**:

1. Migrate the catalog (Alembic ``upgrade``): an empty database gets the schema.
2. Scan every configured region (``ensure_ready`` + list every key) for
   ``{run}/step-{12 digits}/MANIFEST.json``. A region that cannot be reached
   is reported and the others are used; its replicas are recorded ``pending``.
3. Per (run, step), across regions: read each region's manifest (one that is
   not JSON or not the format is reported and ignored), then stream every
   object it lists (``iter_range``, bounded chunks, a few objects at a time,
   SHA-256 in a thread) and compare size and hash.
4. One transaction per checkpoint: run, checkpoint, one shard per rank, files
   and one replica per configured region: ``committed`` where every object
   verified, ``corrupt`` (the error names the bad objects) where not,
   ``pending`` where the region has no (usable) manifest, could not be read,
   or was unreachable. The state comes from ``refresh_state``. Replicate jobs
   are queued for pending/corrupt replicas when an intact copy exists
   elsewhere, so the service repairs and completes them.

Choices:

- **Which manifest wins.** When the regions' manifests disagree (a file's
  hash, the file list, world_size), the content whose objects actually verify
  wins (most regions verifying it, then configuration order, primary first).
  A region whose manifest disagrees with the winner is ``corrupt`` even if its
  own objects match its own manifest: the replicate job rewrites it.
- **Read errors are not corruption.** An object that cannot be read (outage,
  timeout) leaves the replica ``pending`` (status ``unverified``), never
  ``corrupt``; a missing object or one whose size/hash differs is corrupt.
- **Shards.** The T0 copy is unknown after a disaster: each shard is
  recorded on node ``"rebuilt"`` (no agent has that name, so no local copy
  is ever offered) with path ``""``, state ``uploaded``; files have
  ``mtime_ns`` 0 and ``sha256`` = ``expected_sha256`` = the verified hash.
  The shard fingerprint is the SHA-256 of the rank's ``[[path, size,
  sha256], …]``; a trainer re-registering that rank gets 409 (the step is
  already durable with its content).
- **State when too few copies verify.** With at least one verified copy but
  fewer than ``min_regions``: ``uploading`` (replication brings it to
  ``min_regions`` and ``refresh_state`` then makes it durable). With none:
  ``corrupt`` with an error starting "no intact copy", which
  ``refresh_state`` clears if a later rebuild or repair commits enough copies.
- **Idempotent.** A (run, step) already in the catalog keeps its checkpoint,
  shard and file rows untouched. Only its replicas that are missing or still
  ``pending`` are examined (against the catalog's hashes, not the
  manifest's), and only a fully verified one is filled in as committed.
  Running the rebuild twice changes nothing the second time (job enqueueing
  is deduplicated by the queue).
- Checkpoints whose row is ``failed`` or ``deleted`` are left alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from sqlalchemy import insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ..checkpoints import repository as repo
from ..checkpoints.state import FINAL, refresh_state
from ..config import NAME_PATTERN, Settings
from ..db import create_engine, create_sessionmaker, transaction
from ..jobs import queue
from ..migrate import upgrade
from ..models import (
    Checkpoint,
    CheckpointState,
    File,
    JobKind,
    Replica,
    ReplicaState,
    Shard,
    ShardState,
    priority_of,
    utcnow,
)
from ..replication.jobs import REPLICATE_MAX_ATTEMPTS
from ..storage import layout
from ..storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StoreError
from ..storage.factory import Stores, build_stores
from ..uploads.manifest import manifest_digest, parse_manifest

log = logging.getLogger("tierckpt.rebuild")

MANIFEST_KEY = re.compile(
    r"^(?P<run>[A-Za-z0-9._-]{1,128})/step-(?P<step>[0-9]{12})/"
    + re.escape(layout.MANIFEST_NAME)
    + "$"
)
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
MAX_MANIFEST_BYTES = 256 << 20
CHUNK_SIZE = 4 << 20
REBUILT_NODE = "rebuilt"
NAMED_OBJECTS = 5  # bad objects named in a replica's error
MAX_ERROR = 4000

# Per-region outcome of a checkpoint (RegionResult.status).
VERIFIED = "verified"  # manifest present, every object verified -> committed
CORRUPT = "corrupt"  # manifest present, an object is missing/different, or the manifest disagrees
MISSING = "missing"  # no (usable) manifest in that region -> pending
UNVERIFIED = "unverified"  # could not be read (outage): no verdict -> pending
UNREACHABLE = "unreachable"  # region unreachable during the scan -> pending
KEPT = "kept"  # already in the catalog; not re-examined
STATUSES = (VERIFIED, CORRUPT, MISSING, UNVERIFIED, UNREACHABLE, KEPT)

T = TypeVar("T")


class CatalogUnreachable(Exception):
    """The catalog could not be migrated or written: nothing can be rebuilt."""


class InvalidManifest(ValueError):
    pass


# -- report ------------------------------------------------------------------


@dataclass
class RegionResult:
    status: str
    replica: str | None  # the replica's state in the catalog after the rebuild
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "replica": self.replica, "error": self.error}


@dataclass
class CheckpointResult:
    run: str
    step: int
    action: str  # created | updated | unchanged | skipped
    state: str | None
    world_size: int | None = None
    file_count: int | None = None
    total_bytes: int | None = None
    regions: dict[str, RegionResult] = field(default_factory=dict)
    jobs_enqueued: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "action": self.action,
            "state": self.state,
            "world_size": self.world_size,
            "file_count": self.file_count,
            "total_bytes": self.total_bytes,
            "regions": {name: r.to_json() for name, r in self.regions.items()},
            "jobs_enqueued": self.jobs_enqueued,
            "error": self.error,
        }


@dataclass
class RebuildReport:
    regions: list[str]
    checkpoints: list[CheckpointResult] = field(default_factory=list)
    regions_unreachable: list[dict[str, str]] = field(default_factory=list)
    manifests_invalid: list[dict[str, str]] = field(default_factory=list)

    @property
    def nothing_reachable(self) -> bool:
        return bool(self.regions) and len(self.regions_unreachable) == len(self.regions)

    def totals(self) -> dict[str, int]:
        actions = Counter(c.action for c in self.checkpoints)
        statuses = Counter(r.status for c in self.checkpoints for r in c.regions.values())
        return {
            "checkpoints": len(self.checkpoints),
            **{a: actions[a] for a in ("created", "updated", "unchanged", "skipped")},
            "valid": sum(1 for c in self.checkpoints if c.state in _VALID_STATES),
            **{f"replicas_{s}": statuses[s] for s in STATUSES},
            "jobs_enqueued": sum(c.jobs_enqueued for c in self.checkpoints),
            "regions_unreachable": len(self.regions_unreachable),
            "manifests_invalid": len(self.manifests_invalid),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "regions_unreachable": self.regions_unreachable,
            "manifests_invalid": self.manifests_invalid,
            "totals": self.totals(),
        }


_VALID_STATES = (CheckpointState.DURABLE, CheckpointState.REPLICATED)
_STYLE = {
    VERIFIED: "green",
    CORRUPT: "red",
    MISSING: "yellow",
    UNVERIFIED: "yellow",
    UNREACHABLE: "red",
    KEPT: "dim",
    "durable": "green",
    "replicated": "green",
    "corrupt": "red",
    "uploading": "yellow",
}


def render_report(report: RebuildReport) -> RenderableType:
    """The human summary: one row per checkpoint, one column per region."""
    table = Table(title="catalog rebuild", title_justify="left")
    for column in ("run", "step", "state", "action"):
        table.add_column(column, justify="right" if column == "step" else "left")
    for region in report.regions:
        table.add_column(region)
    problems: list[str] = []
    for c in report.checkpoints:
        cells: list[RenderableType] = [
            c.run,
            str(c.step),
            Text(c.state or "-", style=_STYLE.get(c.state or "", "")),
            c.action,
        ]
        for region in report.regions:
            result = c.regions.get(region)
            if result is None:
                cells.append(Text("-", style="dim"))
                continue
            label = result.status
            if result.replica and result.status not in (VERIFIED, CORRUPT):
                label += f" ({result.replica})"
            cells.append(Text(label, style=_STYLE.get(result.status, "")))
            if result.error and result.status != KEPT:
                problems.append(f"{c.run}:{c.step} {region}: {result.error}")
        if c.error:
            problems.append(f"{c.run}:{c.step}: {c.error}")
        table.add_row(*cells)
    parts: list[RenderableType] = [table]
    for line in problems:
        parts.append(Text(line, style="yellow"))
    for entry in report.regions_unreachable:
        parts.append(Text(f"region {entry['region']} unreachable: {entry['error']}", style="red"))
    for entry in report.manifests_invalid:
        parts.append(
            Text(
                f"invalid manifest {entry['uri']} ({entry['region']}): {entry['error']}",
                style="red",
            )
        )
    t = report.totals()
    parts.append(
        Text(
            f"{t['checkpoints']} checkpoint(s): {t['created']} created, {t['updated']} updated, "
            f"{t['unchanged']} unchanged, {t['skipped']} skipped; {t['valid']} valid. "
            f"Replicas: {t['replicas_verified']} verified, {t['replicas_corrupt']} corrupt, "
            f"{t['replicas_missing']} missing, {t['replicas_unverified']} unverified, "
            f"{t['replicas_unreachable']} unreachable, {t['replicas_kept']} kept. "
            f"{t['jobs_enqueued']} replicate job(s) queued."
        )
    )
    return Group(*parts)


# -- manifests ---------------------------------------------------------------


@dataclass(frozen=True, order=True)
class ManifestEntry:
    rank: int
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    region: str
    digest: str
    world_size: int
    epoch: int | None
    parent: tuple[str, int] | None
    metrics: dict[str, float]
    metadata: dict[str, Any]
    created_at: datetime
    files: tuple[ManifestEntry, ...]  # sorted by (rank, path)

    @property
    def content(self) -> Content:
        return (self.world_size, self.files)


# What must agree between a region and the winning manifest (or the catalog).
Content = tuple[int, tuple[ManifestEntry, ...]]


def _integer(name: str, value: Any, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidManifest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _relative_path(path: Any) -> str:
    """A file path the object key may be built from: relative, no '.'/'..'/empty parts."""
    if (
        not isinstance(path, str)
        or not 0 < len(path) <= 4096
        or "\x00" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise InvalidManifest(f"file path {path!r} is not a safe relative path")
    return path


def _timestamp(value: Any) -> datetime:
    if not isinstance(value, str):
        raise InvalidManifest(f"created_at must be an ISO timestamp, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value.removesuffix("Z"))
    except ValueError:
        raise InvalidManifest(f"created_at is not an ISO timestamp: {value!r}") from None
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return parsed


def read_manifest(region: str, data: bytes, run: str, step: int) -> Manifest:
    """Parse and check one region's MANIFEST.json; InvalidManifest says why not."""
    try:
        document = parse_manifest(data)
    except (ValueError, TypeError, AttributeError) as exc:
        raise InvalidManifest(f"not a tierckpt manifest: {exc}") from None
    if document.get("run") != run or document.get("step") != step:
        raise InvalidManifest(
            f"names {document.get('run')!r} step {document.get('step')!r}, "
            f"but is stored under {run} step {step}"
        )
    world_size = _integer("world_size", document.get("world_size"), 1)
    epoch = document.get("epoch")
    if epoch is not None:
        epoch = _integer("epoch", epoch)
    parent: tuple[str, int] | None = None
    raw_parent = document.get("parent")
    if raw_parent is not None:
        if (
            not isinstance(raw_parent, dict)
            or not isinstance(raw_parent.get("run"), str)
            or not NAME_PATTERN.match(raw_parent["run"])
        ):
            raise InvalidManifest(f"parent must be {{run, step}}, got {raw_parent!r}")
        parent = (raw_parent["run"], _integer("parent.step", raw_parent.get("step")))
    raw_metrics = document.get("metrics") or {}
    if not isinstance(raw_metrics, dict):
        raise InvalidManifest("metrics must be an object")
    metrics: dict[str, float] = {}
    for name, value in raw_metrics.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            raise InvalidManifest(f"metric {name!r} is not a finite number: {value!r}")
        metrics[name] = float(value)
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidManifest("metadata must be an object")
    raw_files = document.get("files")
    if not isinstance(raw_files, list):
        raise InvalidManifest("files must be a list")
    files: list[ManifestEntry] = []
    seen: set[tuple[int, str]] = set()
    for raw in raw_files:
        if not isinstance(raw, dict):
            raise InvalidManifest(f"files[] entries must be objects, got {raw!r}")
        rank = _integer("files[].rank", raw.get("rank"))
        if rank >= world_size:
            raise InvalidManifest(f"file rank {rank} is not below world_size {world_size}")
        path = _relative_path(raw.get("path"))
        sha256 = raw.get("sha256")
        if not isinstance(sha256, str) or not SHA256_HEX.match(sha256):
            raise InvalidManifest(f"file {path!r}: sha256 is not 64 lowercase hex digits")
        if (rank, path) in seen:
            raise InvalidManifest(f"file {path!r} of rank {rank} is listed twice")
        seen.add((rank, path))
        files.append(ManifestEntry(rank, path, _integer("files[].size", raw.get("size")), sha256))
    return Manifest(
        region=region,
        digest=manifest_digest(data),
        world_size=world_size,
        epoch=epoch,
        parent=parent,
        metrics=metrics,
        metadata=metadata,
        created_at=_timestamp(document.get("created_at")),
        files=tuple(sorted(files)),
    )


async def _read_all(store: ObjectStore, key: str, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    stream = store.iter_range(key, chunk_size=CHUNK_SIZE)
    try:
        async for chunk in stream:
            total += len(chunk)
            if total > limit:
                raise InvalidManifest(f"larger than {limit} bytes")
            chunks.append(chunk)
    finally:
        await _aclose(stream)
    return b"".join(chunks)


async def _aclose(stream: AsyncIterator[bytes]) -> None:
    # iter_range is an async generator on every store; closing it releases
    # the HTTP body / file at once when we stop reading early.
    close: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if close is not None:
        await close()


# -- verification ------------------------------------------------------------


@dataclass
class Verification:
    bad: list[str] = field(default_factory=list)  # "key (why)": missing, size or hash differs
    unreadable: list[str] = field(default_factory=list)  # read errors: no verdict

    @property
    def ok(self) -> bool:
        return not self.bad and not self.unreadable


async def _hash_object(store: ObjectStore, key: str, limit: int) -> tuple[int, str]:
    """(size, sha256) of an object, streamed; stops reading past ``limit`` bytes."""
    hasher = hashlib.sha256()
    size = 0
    stream = store.iter_range(key, chunk_size=CHUNK_SIZE)
    try:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                break
            await asyncio.to_thread(hasher.update, chunk)
    finally:
        await _aclose(stream)
    return size, hasher.hexdigest()


async def _bounded(items: Iterable[T], width: int, work: Callable[[T], Awaitable[None]]) -> None:
    """Run ``work`` over ``items`` with at most ``width`` at a time, without
    creating a task per item (a manifest may list 100 000 files)."""
    iterator: Iterator[T] = iter(items)

    async def worker() -> None:
        for item in iterator:
            await work(item)

    async with asyncio.TaskGroup() as group:
        for _ in range(max(1, width)):
            group.create_task(worker())


async def verify_objects(
    store: ObjectStore,
    run: str,
    step: int,
    files: Iterable[ManifestEntry],
    slots: asyncio.Semaphore,
    width: int,
) -> Verification:
    result = Verification()

    async def one(entry: ManifestEntry) -> None:
        key = layout.object_key(run, step, entry.rank, entry.path)
        async with slots:
            try:
                size, digest = await _hash_object(store, key, entry.size)
            except ObjectNotFound:
                result.bad.append(f"{key} (missing)")
                return
            except Exception as exc:  # an outage is not corruption: no verdict
                log.warning("%s: reading %s failed: %s", store.region, key, exc)
                result.unreadable.append(f"{key} ({type(exc).__name__}: {exc})")
                return
        if size > entry.size:
            result.bad.append(f"{key} (larger than the manifest's {entry.size} bytes)")
        elif size != entry.size:
            result.bad.append(f"{key} (size {size} != {entry.size})")
        elif digest != entry.sha256:
            result.bad.append(f"{key} (sha256 {digest[:12]}… != {entry.sha256[:12]}…)")

    await _bounded(files, width, one)
    result.bad.sort()
    result.unreadable.sort()
    return result


def _name_some(items: list[str]) -> str:
    shown = ", ".join(items[:NAMED_OBJECTS])
    if len(items) > NAMED_OBJECTS:
        shown += f", and {len(items) - NAMED_OBJECTS} more"
    return shown


# -- one region's look at one checkpoint --------------------------------------


@dataclass
class RegionCheck:
    manifest: Manifest | None = None
    verification: Verification | None = None
    status: str | None = None  # set when there is no manifest to judge
    error: str | None = None


@dataclass
class _Context:
    settings: Settings
    stores: Stores
    sessionmaker: async_sessionmaker[AsyncSession]
    slots: asyncio.Semaphore
    objects_in_flight: int
    report: RebuildReport
    unreachable: set[str]


async def _check_region(
    ctx: _Context, store: ObjectStore, run: str, step: int, info: ObjectInfo
) -> RegionCheck:
    try:
        data = await _read_all(store, info.key, MAX_MANIFEST_BYTES)
        manifest = read_manifest(store.region, data, run, step)
    except ObjectNotFound:
        return RegionCheck(status=MISSING, error="MANIFEST.json vanished during the rebuild")
    except InvalidManifest as exc:
        ctx.report.manifests_invalid.append(
            {"region": store.region, "key": info.key, "uri": store.uri(info.key), "error": str(exc)}
        )
        log.warning("%s: invalid manifest %s: %s", store.region, info.key, exc)
        return RegionCheck(status=MISSING, error=f"invalid MANIFEST.json: {exc}")
    except Exception as exc:
        log.warning("%s: reading %s failed: %s", store.region, info.key, exc)
        return RegionCheck(status=UNVERIFIED, error=f"reading MANIFEST.json failed: {exc}")
    verification = await verify_objects(
        store, run, step, manifest.files, ctx.slots, ctx.objects_in_flight
    )
    return RegionCheck(manifest=manifest, verification=verification)


def choose_manifest(checks: dict[str, RegionCheck], order: list[str]) -> Manifest | None:
    """The content whose objects verify in the most regions (then: whose
    objects are at least not proven bad; then configuration order)."""
    held = [name for name in order if (c := checks.get(name)) and c.manifest is not None]
    if not held:
        return None

    def score(name: str) -> tuple[int, int, int]:
        content = checks[name].manifest.content  # type: ignore[union-attr]
        same = [
            checks[o].verification
            for o in held
            if checks[o].manifest.content == content  # type: ignore[union-attr]
        ]
        verified = sum(1 for v in same if v is not None and v.ok)
        not_bad = sum(1 for v in same if v is not None and not v.bad)
        return (-verified, -not_bad, order.index(name))

    best = min(held, key=score)
    return checks[best].manifest


def _difference(expected: Content, manifest: Manifest) -> str:
    world_size, files = expected
    if manifest.world_size != world_size:
        return f"world_size ({manifest.world_size} != {world_size})"
    differing = sorted(
        {f"rank-{e.rank:05d}/{e.path}" for e in set(files).symmetric_difference(manifest.files)}
    )
    return f"{len(differing)} file(s): {_name_some(differing)}"


def judge(check: RegionCheck, expected: Content | None, against: str) -> tuple[str, str | None]:
    """(status, error) of one region's copy against the expected content."""
    if check.manifest is None or check.verification is None:
        return check.status or MISSING, check.error
    v = check.verification
    problems = []
    if v.bad:
        problems.append(
            f"{len(v.bad)} of {len(check.manifest.files)} object(s) do not match "
            f"MANIFEST.json: {_name_some(v.bad)}"
        )
    if expected is not None and check.manifest.content != expected:
        problems.append(
            f"MANIFEST.json disagrees with {against} on {_difference(expected, check.manifest)}"
        )
    if problems:
        return CORRUPT, ("rebuild: " + "; ".join(problems))[:MAX_ERROR]
    if v.unreadable:
        return UNVERIFIED, (
            f"rebuild could not read {len(v.unreadable)} object(s): {_name_some(v.unreadable)}"
        )[:MAX_ERROR]
    if expected is None:
        return UNVERIFIED, "the catalog holds no complete file hashes for this checkpoint yet"
    return VERIFIED, None


# -- catalog -----------------------------------------------------------------


@dataclass(frozen=True)
class _Known:
    state: str
    replicas: dict[str, str]


async def _known(session: AsyncSession, run: str, step: int) -> _Known | None:
    run_row = await repo.find_run(session, run)
    if run_row is None:
        return None
    checkpoint = await repo.find_checkpoint(session, run_row.id, step)
    if checkpoint is None:
        return None
    replicas = await session.scalars(select(Replica).where(Replica.checkpoint_id == checkpoint.id))
    return _Known(checkpoint.state, {r.region: r.state for r in replicas})


async def _catalog_content(session: AsyncSession, checkpoint: Checkpoint) -> Content | None:
    """The catalog's own (world_size, files) when every shard is uploaded and hashed."""
    shards = await repo.shards_of(session, [checkpoint.id])
    if len(shards) != checkpoint.world_size or any(s.state != ShardState.UPLOADED for s in shards):
        return None
    files = await repo.files_of(session, checkpoint.id)
    if any(f.sha256 is None for _rank, f in files):
        return None
    return (
        checkpoint.world_size,
        tuple(sorted(ManifestEntry(rank, f.path, f.size, f.sha256 or "") for rank, f in files)),
    )


def _replica_state(status: str) -> ReplicaState:
    if status == VERIFIED:
        return ReplicaState.COMMITTED
    if status == CORRUPT:
        return ReplicaState.CORRUPT
    return ReplicaState.PENDING


def _new_replica(
    checkpoint_id: int,
    region: str,
    uri: str,
    state: ReplicaState,
    check: RegionCheck | None,
    error: str | None,
    now: datetime,
) -> Replica:
    committed = state == ReplicaState.COMMITTED
    return Replica(
        checkpoint_id=checkpoint_id,
        region=region,
        state=state,
        uri=uri,
        manifest_sha256=check.manifest.digest if committed and check and check.manifest else None,
        error=None if committed else error,
        committed_at=now if committed else None,
        verified_at=now if committed else None,
    )


def _fingerprint(entries: list[ManifestEntry]) -> str:
    listing = [[e.path, e.size, e.sha256] for e in sorted(entries)]
    return hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()


def _region_status_without_check(ctx: _Context, name: str, found: dict[str, ObjectInfo]) -> str:
    if name in ctx.unreachable:
        return UNREACHABLE
    if name not in found:
        return MISSING
    return KEPT


async def _enqueue_repairs(
    session: AsyncSession, ctx: _Context, checkpoint: Checkpoint, states: dict[str, str]
) -> int:
    """Replicate jobs for pending/corrupt replicas, when an intact copy exists."""
    if checkpoint.state in FINAL or ReplicaState.COMMITTED not in states.values():
        return 0
    added = 0
    for region, state in states.items():
        if state in (ReplicaState.PENDING, ReplicaState.CORRUPT) and region in ctx.stores:
            added += await queue.enqueue(
                session,
                JobKind.REPLICATE,
                checkpoint.id,
                region=region,
                priority=priority_of(checkpoint.priority),
                max_attempts=REPLICATE_MAX_ATTEMPTS,
            )
    return added


async def _create(
    session: AsyncSession,
    ctx: _Context,
    run_id: int,
    run: str,
    step: int,
    canonical: Manifest,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult:
    """A checkpoint the catalog does not hold: everything from the winning manifest."""
    checkpoint = Checkpoint(
        run_id=run_id,
        step=step,
        state=CheckpointState.REGISTERED,
        world_size=canonical.world_size,
        epoch=canonical.epoch,
        priority="normal",
        metrics=canonical.metrics,
        meta=canonical.metadata,
        parent_run=canonical.parent[0] if canonical.parent else None,
        parent_step=canonical.parent[1] if canonical.parent else None,
        total_bytes=sum(e.size for e in canonical.files),
        file_count=len(canonical.files),
        created_at=canonical.created_at,
    )
    session.add(checkpoint)
    await session.flush()
    now = utcnow()
    by_rank: dict[int, list[ManifestEntry]] = defaultdict(list)
    for entry in canonical.files:
        by_rank[entry.rank].append(entry)
    shards = [
        Shard(
            checkpoint_id=checkpoint.id,
            rank=rank,
            node=REBUILT_NODE,
            path="",
            state=ShardState.UPLOADED,
            fingerprint=_fingerprint(by_rank[rank]),
            uploaded_at=now,
        )
        for rank in range(canonical.world_size)
    ]
    session.add_all(shards)
    await session.flush()
    if canonical.files:
        await session.execute(
            insert(File),
            [
                {
                    "shard_id": shards[e.rank].id,
                    "path": e.path,
                    "size": e.size,
                    "mtime_ns": 0,
                    "expected_sha256": e.sha256,
                    "sha256": e.sha256,
                }
                for e in canonical.files
            ],
        )

    winner = checks[canonical.region].verification
    against = f"region {canonical.region}'s{' verified' if winner and winner.ok else ''} manifest"
    results: dict[str, RegionResult] = {}
    states: dict[str, str] = {}
    prefix = layout.step_prefix(run, step)
    for name, store in ctx.stores.items():
        check = checks.get(name)
        if check is None:
            status, error = _region_status_without_check(ctx, name, found), None
        else:
            status, error = judge(check, canonical.content, against)
        state = _replica_state(status)
        session.add(_new_replica(checkpoint.id, name, store.uri(prefix), state, check, error, now))
        states[name] = state
        results[name] = RegionResult(status=status, replica=state, error=error)
    await session.flush()

    settings = ctx.settings
    await refresh_state(session, checkpoint, settings.durability.min_regions, len(settings.regions))
    committed_count = sum(1 for s in states.values() if s == ReplicaState.COMMITTED)
    if checkpoint.state == CheckpointState.REGISTERED:
        if committed_count:
            # Valid once replication brings it to min_regions.
            checkpoint.state = CheckpointState.UPLOADING
        else:
            checkpoint.state = CheckpointState.CORRUPT
            checkpoint.error = (
                "no intact copy in any region at catalog rebuild ("
                + ", ".join(f"{n}: {r.status}" for n, r in results.items())
                + ")"
            )
    jobs = await _enqueue_repairs(session, ctx, checkpoint, states)
    return CheckpointResult(
        run=run,
        step=step,
        action="created",
        state=checkpoint.state,
        world_size=checkpoint.world_size,
        file_count=checkpoint.file_count,
        total_bytes=checkpoint.total_bytes,
        regions=results,
        jobs_enqueued=jobs,
        error=checkpoint.error,
    )


async def _fill(
    session: AsyncSession,
    ctx: _Context,
    checkpoint: Checkpoint,
    run: str,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult:
    """A checkpoint the catalog already holds: only missing or pending
    replicas may change, and only to what verifies against the catalog."""
    step = checkpoint.step
    replicas = {
        r.region: r
        for r in await session.scalars(
            select(Replica).where(Replica.checkpoint_id == checkpoint.id)
        )
    }
    final = checkpoint.state in FINAL
    expected = None if final else await _catalog_content(session, checkpoint)
    now = utcnow()
    prefix = layout.step_prefix(run, step)
    results: dict[str, RegionResult] = {}
    states: dict[str, str] = {}
    changed = False
    for name, store in ctx.stores.items():
        check = checks.get(name)
        replica = replicas.get(name)
        if final or check is None:
            status, error = _region_status_without_check(ctx, name, found), None
        else:
            status, error = judge(check, expected, "the catalog")
        manifest = check.manifest if check else None
        if final:
            pass
        elif replica is None:
            replica = _new_replica(
                checkpoint.id, name, store.uri(prefix), _replica_state(status), check, error, now
            )
            session.add(replica)
            changed = True
        elif replica.state == ReplicaState.PENDING and status == VERIFIED and manifest:
            replica.state = ReplicaState.COMMITTED
            replica.manifest_sha256 = manifest.digest
            replica.committed_at = now
            replica.verified_at = now
            replica.error = None
            changed = True
        if replica is not None:
            states[name] = replica.state
        results[name] = RegionResult(
            status=status, replica=replica.state if replica else None, error=error
        )
    if changed:
        await session.flush()
        settings = ctx.settings
        await refresh_state(
            session, checkpoint, settings.durability.min_regions, len(settings.regions)
        )
    jobs = 0 if final else await _enqueue_repairs(session, ctx, checkpoint, states)
    return CheckpointResult(
        run=run,
        step=step,
        action="updated" if changed else "unchanged",
        state=checkpoint.state,
        world_size=checkpoint.world_size,
        file_count=checkpoint.file_count,
        total_bytes=checkpoint.total_bytes,
        regions=results,
        jobs_enqueued=jobs,
        error=checkpoint.error,
    )


async def _rebuild_checkpoint(
    ctx: _Context, run: str, step: int, found: dict[str, ObjectInfo]
) -> CheckpointResult | None:
    async with transaction(ctx.sessionmaker) as session:
        known = await _known(session, run, step)
    # Which regions to read: all that hold a manifest for a new checkpoint;
    # for a known one only those whose replica could still change.
    to_check = [
        name
        for name in ctx.stores
        if name in found
        and (
            known is None
            or (
                known.state not in FINAL
                and known.replicas.get(name) in (None, ReplicaState.PENDING)
            )
        )
    ]
    checked = await asyncio.gather(
        *(_check_region(ctx, ctx.stores[name], run, step, found[name]) for name in to_check)
    )
    checks = dict(zip(to_check, checked, strict=True))
    if known is None and choose_manifest(checks, list(ctx.stores)) is None:
        return _skipped(ctx, run, step, checks, found)

    for _attempt in range(2):
        try:
            async with transaction(ctx.sessionmaker) as session:
                run_row = await repo.get_or_create_run(session, run)
                checkpoint = await repo.find_checkpoint(session, run_row.id, step, for_update=True)
                if checkpoint is not None:
                    return await _fill(session, ctx, checkpoint, run, checks, found)
                canonical = choose_manifest(checks, list(ctx.stores))
                if canonical is None:
                    # Deleted from the catalog since it was read: nothing to create from.
                    return _skipped(ctx, run, step, checks, found)
                return await _create(session, ctx, run_row.id, run, step, canonical, checks, found)
        except IntegrityError:
            # An agent created the same run/step meanwhile: the next attempt
            # takes the existing-checkpoint path.
            continue
    raise CatalogUnreachable(f"{run}:{step} could not be written to the catalog")


def _skipped(
    ctx: _Context,
    run: str,
    step: int,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult | None:
    """No usable manifest. Only invalid ones (already reported): not a
    checkpoint. Some unreadable: say so, a rerun may rebuild it."""
    if not any(c.status == UNVERIFIED for c in checks.values()):
        return None
    regions = {}
    for name in ctx.stores:
        check = checks.get(name)
        if check is None:
            regions[name] = RegionResult(_region_status_without_check(ctx, name, found), None)
        else:
            regions[name] = RegionResult(check.status or MISSING, None, check.error)
    return CheckpointResult(
        run=run,
        step=step,
        action="skipped",
        state=None,
        regions=regions,
        error="no readable manifest; rerun rebuild-catalog once the region is reachable",
    )


# -- scan --------------------------------------------------------------------


async def _scan_region(store: ObjectStore) -> list[tuple[str, int, ObjectInfo]]:
    await store.ensure_ready()
    found = []
    async for info in store.list(""):
        match = MANIFEST_KEY.match(info.key)
        if match:
            found.append((match["run"], int(match["step"]), info))
    return found


async def _scan(
    ctx: _Context,
) -> dict[tuple[str, int], dict[str, ObjectInfo]]:
    names = list(ctx.stores)
    scans = await asyncio.gather(
        *(_scan_region(ctx.stores[name]) for name in names), return_exceptions=True
    )
    found: dict[tuple[str, int], dict[str, ObjectInfo]] = defaultdict(dict)
    for name, outcome in zip(names, scans, strict=True):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            # A partial listing is discarded: its region counts as unreachable
            # (replicas pending), which a later rebuild fills in.
            message = (
                str(outcome)
                if isinstance(outcome, StoreError)
                else (f"{type(outcome).__name__}: {outcome}")
            )
            log.warning("region %s unreachable: %s", name, message)
            ctx.unreachable.add(name)
            ctx.report.regions_unreachable.append({"region": name, "error": message})
            continue
        log.info("region %s: %d manifest(s)", name, len(outcome))
        for run, step, info in outcome:
            found[(run, step)][name] = info
    return found


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _shown(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<catalog>"


async def rebuild(
    settings: Settings, *, objects_in_flight: int = 4, checkpoints_in_flight: int = 2
) -> RebuildReport:
    """Recreate (or complete) the catalog from every configured region's manifests.

    Raises CatalogUnreachable when the catalog cannot be migrated or written.
    Regions that cannot be reached are in ``report.regions_unreachable``.
    """
    url = settings.catalog.url
    try:
        await asyncio.to_thread(upgrade, url)
    except Exception as exc:
        raise CatalogUnreachable(f"catalog {_shown(url)}: {type(exc).__name__}: {exc}") from exc
    engine = create_engine(url)
    stores = build_stores(settings)
    report = RebuildReport(regions=list(stores))
    ctx = _Context(
        settings=settings,
        stores=stores,
        sessionmaker=create_sessionmaker(engine),
        slots=asyncio.Semaphore(objects_in_flight),
        objects_in_flight=objects_in_flight,
        report=report,
        unreachable=set(),
    )
    try:
        found = await _scan(ctx)
        results: dict[tuple[str, int], CheckpointResult] = {}

        async def one(item: tuple[tuple[str, int], dict[str, ObjectInfo]]) -> None:
            (run, step), where = item
            result = await _rebuild_checkpoint(ctx, run, step, where)
            if result is not None:
                results[(run, step)] = result
                log.info(
                    "%s:%d %s, %s (%s)",
                    run,
                    step,
                    result.action,
                    result.state,
                    ", ".join(f"{n} {r.status}" for n, r in result.regions.items()),
                )

        try:
            await _bounded(sorted(found.items()), checkpoints_in_flight, one)
        except BaseExceptionGroup as group:
            first = _first_leaf(group)
            if isinstance(first, CatalogUnreachable):
                raise first from None
            if isinstance(first, SQLAlchemyError | OSError):
                raise CatalogUnreachable(
                    f"catalog {_shown(url)}: {type(first).__name__}: {first}"
                ) from first
            raise
        report.checkpoints = [results[k] for k in sorted(results)]
        report.manifests_invalid.sort(key=lambda e: (e["region"], e["key"]))
        return report
    finally:
        await stores.aclose()
        await engine.dispose()
