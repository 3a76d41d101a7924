"""MANIFEST.json, the self-describing commit marker of a checkpoint in a
region, and ``ObjectEntry``, the (key, size, sha256) of one stored object.

The manifest lists every rank's files with size and SHA-256, so ``aws s3 cp
--recursive`` plus ``sha256sum`` is enough to use and check a checkpoint, and
a lost catalog can be rebuilt from the manifests alone. This module is the
only one that writes (``build_manifest``) or reads (``parse_manifest``) it.

Invariants:

- ``build_manifest`` is deterministic: the same checkpoint gives the same
  bytes in every region of one key layout (sorted keys, files sorted by rank
  then path), so a replica's ``manifest_sha256`` can be compared across
  regions and over time. A region with a hashed key prefix says so
  (``key_layout``, see layout.py); the plain layout writes no such field.
- A file whose chunk hashes are known (``storage/chunks.py``) also lists
  ``chunk_size`` and ``chunk_sha256``; one without them is written exactly
  as before, so a manifest of a checkpoint uploaded before chunk hashes
  existed keeps its bytes.
- ``parse_manifest`` trusts nothing: the bytes come from a bucket, maybe
  written by hand. Every field a catalog row or an object key is built from
  is checked, and a manifest that fails a check raises ``InvalidManifest``
  saying why; keys are only built from safe relative paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..names import NAME_PATTERN
from . import chunks, layout

FORMAT = "tierckpt.manifest/1"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, order=True)
class ObjectEntry:
    """One object of a checkpoint in a region: its key (``layout.object_key``,
    without the region's prefix), its size and its SHA-256 ("" while the
    catalog does not know it yet)."""

    key: str
    size: int
    sha256: str
    # The chunks' SHA-256s (chunks.py), None when unknown. Not part of the
    # entry's identity: two copies of an object agree when key, size and
    # SHA-256 do, whether or not one of them was described with chunks.
    chunk_size: int | None = field(default=None, compare=False)
    chunk_sha256: tuple[str, ...] | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        run: str,
        step: int,
        rank: int,
        path: str,
        size: int,
        sha256: str,
        chunk_size: int | None = None,
        chunk_sha256: Sequence[str] | None = None,
    ) -> ObjectEntry:
        known = chunk_size is not None and chunk_sha256 is not None
        return cls(
            layout.object_key(run, step, rank, path),
            size,
            sha256,
            chunk_size if known else None,
            tuple(chunk_sha256) if known and chunk_sha256 is not None else None,
        )

    @property
    def rank(self) -> int:
        return layout.rank_and_path(self.key)[0]

    @property
    def path(self) -> str:
        """The file's path relative to its rank's directory."""
        return layout.rank_and_path(self.key)[1]


class InvalidManifest(ValueError):
    """A MANIFEST.json that is not one, or not one for where it is stored."""


# -- writing -------------------------------------------------------------------


def build_manifest(
    *,
    run: str,
    step: int,
    world_size: int,
    epoch: int | None,
    parent: dict[str, Any] | None,
    metrics: dict[str, float],
    metadata: dict[str, Any],
    created_at: datetime,
    files: Iterable[ObjectEntry],
    key_layout: str | None = None,
) -> bytes:
    """The manifest's bytes; ``created_at`` is naive UTC, written with a "Z"."""
    prefix = layout.step_prefix(run, step)
    listed = []
    for entry in files:
        if not entry.key.startswith(prefix):
            raise ValueError(f"{entry.key} is not an object of {run} step {step}")
        listed.append((entry.rank, entry.path, entry))
    listed.sort(key=lambda item: (item[0], item[1]))
    document: dict[str, Any] = {
        "format": FORMAT,
        "run": run,
        "step": step,
        "world_size": world_size,
        "epoch": epoch,
        "parent": parent,
        "metrics": metrics,
        "metadata": metadata,
        "created_at": created_at.isoformat() + "Z",
        "files": [_file_document(rank, path, e) for rank, path, e in listed],
    }
    if key_layout is not None:
        document["key_layout"] = key_layout
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False).encode()


def _file_document(rank: int, path: str, entry: ObjectEntry) -> dict[str, Any]:
    document: dict[str, Any] = {
        "rank": rank,
        "path": path,
        "size": entry.size,
        "sha256": entry.sha256,
    }
    if entry.chunk_size is not None and entry.chunk_sha256 is not None:
        document["chunk_size"] = entry.chunk_size
        document["chunk_sha256"] = list(entry.chunk_sha256)
    return document


def manifest_digest(data: bytes) -> str:
    """What a replica records as its ``manifest_sha256``."""
    return hashlib.sha256(data).hexdigest()


# -- reading -------------------------------------------------------------------


# What must agree between two copies of a checkpoint: world_size and the
# files, sorted (ObjectEntry order).
Content = tuple[int, tuple[ObjectEntry, ...]]


@dataclass(frozen=True)
class Manifest:
    digest: str
    world_size: int
    epoch: int | None
    parent: tuple[str, int] | None
    metrics: dict[str, float]
    metadata: dict[str, Any]
    created_at: datetime  # naive UTC
    files: tuple[ObjectEntry, ...]  # sorted
    key_layout: str | None = None  # where the objects are (layout.py); None: plain

    @property
    def content(self) -> Content:
        return (self.world_size, self.files)


def parse_manifest(data: bytes, run: str, step: int) -> Manifest:
    """Parse and check the MANIFEST.json stored for ``run`` step ``step``."""
    try:
        document = _document(data)
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
    parent = _parent(document.get("parent"))
    metrics = _metrics(document.get("metrics") or {})
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidManifest("metadata must be an object")
    files = _files(document.get("files"), run, step, world_size)
    key_layout = document.get("key_layout")
    if key_layout not in (None, layout.HASHED_LAYOUT):
        raise InvalidManifest(f"unknown key_layout {key_layout!r}")
    return Manifest(
        digest=manifest_digest(data),
        world_size=world_size,
        epoch=epoch,
        parent=parent,
        metrics=metrics,
        metadata=metadata,
        created_at=_timestamp(document.get("created_at")),
        files=files,
        key_layout=key_layout,
    )


def _document(data: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(data)
    if document.get("format") != FORMAT:
        raise ValueError(f"not a tierckpt manifest (format {document.get('format')!r})")
    return document


def _integer(name: str, value: Any, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidManifest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _parent(raw: Any) -> tuple[str, int] | None:
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("run"), str)
        or not NAME_PATTERN.match(raw["run"])
    ):
        raise InvalidManifest(f"parent must be {{run, step}}, got {raw!r}")
    return (raw["run"], _integer("parent.step", raw.get("step")))


def _metrics(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise InvalidManifest("metrics must be an object")
    metrics: dict[str, float] = {}
    for name, value in raw.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            raise InvalidManifest(f"metric {name!r} is not a finite number: {value!r}")
        metrics[name] = float(value)
    return metrics


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


def _files(raw_files: Any, run: str, step: int, world_size: int) -> tuple[ObjectEntry, ...]:
    if not isinstance(raw_files, list):
        raise InvalidManifest("files must be a list")
    files: list[ObjectEntry] = []
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
        size = _integer("files[].size", raw.get("size"))
        chunk_size, chunk_sha256 = raw.get("chunk_size"), raw.get("chunk_sha256")
        if (chunk_size, chunk_sha256) != (None, None) and not chunks.valid(
            size, chunk_size, chunk_sha256
        ):
            raise InvalidManifest(
                f"file {path!r}: chunk_sha256 must list one SHA-256 per chunk_size chunk"
            )
        files.append(ObjectEntry.of(run, step, rank, path, size, sha256, chunk_size, chunk_sha256))
    return tuple(sorted(files))


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


# -- shard identity --------------------------------------------------------------


def shard_fingerprint(rows: Iterable[Sequence[str | int | None]]) -> str:
    """Identity of a shard's content, stored in ``shards.fingerprint`` and
    compared when the same rank registers again (equal: the same
    registration; different: 409): the SHA-256 of its file rows as compact
    JSON.

    A registration's rows are ``[path, size, mtime_ns, sha256 or null]`` in
    scan order. A shard rebuilt from a manifest has no mtime: its rows are
    ``[path, size, sha256]`` sorted by path, so it never equals a
    registration's and re-registering a rebuilt rank is refused.
    """
    listing = [list(row) for row in rows]
    return hashlib.sha256(json.dumps(listing, separators=(",", ":")).encode()).hexdigest()
