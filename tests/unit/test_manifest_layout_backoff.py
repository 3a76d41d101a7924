"""Pure pieces: object layout, backoff, registration fingerprint (the manifest
format: test_manifest.py)."""

from __future__ import annotations

from pathlib import Path

from tierckpt.service.checkpoints.scan import ScannedFile, ScannedShard
from tierckpt.service.checkpoints.service import fingerprint
from tierckpt.service.jobs.queue import backoff_seconds, dedupe_key
from tierckpt.service.storage import layout


def test_layout_is_plain_and_sortable() -> None:
    assert layout.object_key("run", 42, 3, "a/b.bin") == "run/step-000000000042/rank-00003/a/b.bin"
    assert layout.manifest_key("run", 42) == "run/step-000000000042/MANIFEST.json"
    keys = [layout.step_prefix("r", s) for s in (2, 10, 100)]
    assert keys == sorted(keys)


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
