"""MANIFEST.json: the self-describing commit marker of a checkpoint in a region.

It lists every rank's files with size and SHA-256, so ``aws s3 cp
--recursive`` plus ``sha256sum`` is enough to use and check a checkpoint,
and a lost catalog can be rebuilt from the manifests alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

FORMAT = "tierckpt.manifest/1"


@dataclass(frozen=True)
class ManifestFile:
    rank: int
    path: str
    size: int
    sha256: str


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
    files: list[ManifestFile],
) -> bytes:
    document = {
        "format": FORMAT,
        "run": run,
        "step": step,
        "world_size": world_size,
        "epoch": epoch,
        "parent": parent,
        "metrics": metrics,
        "metadata": metadata,
        "created_at": created_at.isoformat() + "Z",
        "files": [
            {"rank": f.rank, "path": f.path, "size": f.size, "sha256": f.sha256}
            for f in sorted(files, key=lambda f: (f.rank, f.path))
        ],
    }
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False).encode()


def manifest_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_manifest(data: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(data)
    if document.get("format") != FORMAT:
        raise ValueError(f"not a tierckpt manifest (format {document.get('format')!r})")
    return document
