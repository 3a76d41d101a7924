"""Pure pieces: object layout, manifest format, backoff, registration fingerprint."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tierckpt.service.checkpoints.scan import ScannedFile, ScannedShard
from tierckpt.service.checkpoints.service import fingerprint
from tierckpt.service.jobs.queue import backoff_seconds, dedupe_key
from tierckpt.service.storage import layout
from tierckpt.service.uploads.manifest import ManifestFile, build_manifest, parse_manifest


def test_layout_is_plain_and_sortable() -> None:
    assert layout.object_key("run", 42, 3, "a/b.bin") == "run/step-000000000042/rank-00003/a/b.bin"
    assert layout.manifest_key("run", 42) == "run/step-000000000042/MANIFEST.json"
    keys = [layout.step_prefix("r", s) for s in (2, 10, 100)]
    assert keys == sorted(keys)


def test_manifest_is_deterministic_and_complete() -> None:
    files = [ManifestFile(1, "z", 2, "b" * 64), ManifestFile(0, "a", 1, "a" * 64)]
    kwargs = dict(
        run="r",
        step=7,
        world_size=2,
        epoch=1,
        parent={"run": "p", "step": 3},
        metrics={"loss": 0.5},
        metadata={"k": "é"},
        created_at=datetime(2026, 1, 1),
    )
    first = build_manifest(files=files, **kwargs)  # type: ignore[arg-type]
    again = build_manifest(files=list(reversed(files)), **kwargs)  # type: ignore[arg-type]
    assert first == again
    document = parse_manifest(first)
    assert [(f["rank"], f["path"]) for f in document["files"]] == [(0, "a"), (1, "z")]
    assert document["parent"] == {"run": "p", "step": 3} and document["metadata"] == {"k": "é"}
    assert json.loads(first)["created_at"] == "2026-01-01T00:00:00Z"


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    early = [backoff_seconds(1, 1.0, 60) for _ in range(200)]
    late = [backoff_seconds(12, 1.0, 60) for _ in range(200)]
    assert all(0.5 <= d <= 1.0 for d in early)
    assert all(0.5 <= d <= 60 for d in late) and max(late) > 30
    assert len(set(late)) > 100  # jittered: no thundering herd


def test_dedupe_key_names_the_unit_of_work() -> None:
    assert dedupe_key("upload", 1, 2, "east") != dedupe_key("upload", 1, 3, "east")
    assert dedupe_key("commit", 1, None, "east") == "commit:1:-:east"


def test_fingerprint_changes_with_content_metadata() -> None:
    base = ScannedShard(Path("/x"), [ScannedFile("a", 1, 10)])
    assert fingerprint(base, {}) == fingerprint(
        ScannedShard(Path("/y"), [ScannedFile("a", 1, 10)]), {}
    )
    assert fingerprint(base, {}) != fingerprint(
        ScannedShard(Path("/x"), [ScannedFile("a", 1, 11)]), {}
    )
    assert fingerprint(base, {}) != fingerprint(base, {"a": "f" * 64})
