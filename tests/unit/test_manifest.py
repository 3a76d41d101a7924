"""The manifest module (build, parse, the shard fingerprint) and the object verifier."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest

from tierckpt.service.checkpoints.scan import ScannedFile, ScannedShard
from tierckpt.service.checkpoints.service import fingerprint
from tierckpt.service.config import RegionSettings
from tierckpt.service.integrity.verifier import verify_objects
from tierckpt.service.storage import layout
from tierckpt.service.storage.base import StoreError
from tierckpt.service.storage.manifest import (
    InvalidManifest,
    ObjectEntry,
    build_manifest,
    manifest_digest,
    parse_manifest,
    shard_fingerprint,
)
from tierckpt.service.storage.posix import PosixStore

EMPTY_SHA = hashlib.sha256(b"").hexdigest()

# A MANIFEST.json as written by every release so far: it must keep parsing,
# and the same checkpoint must keep giving these exact bytes.
STORED = """{
 "created_at": "2025-03-04T05:06:07.890000Z",
 "epoch": 3,
 "files": [
  {
   "path": "a.bin",
   "rank": 0,
   "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
   "size": 0
  },
  {
   "path": "z/y",
   "rank": 0,
   "sha256": "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc",
   "size": 7
  },
  {
   "path": "w/b.bin",
   "rank": 1,
   "sha256": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
   "size": 5
  }
 ],
 "format": "tierckpt.manifest/1",
 "metadata": {
  "note": "näive"
 },
 "metrics": {
  "loss": 0.25
 },
 "parent": {
  "run": "base",
  "step": 40
 },
 "run": "llm",
 "step": 42,
 "world_size": 2
}""".encode()
STORED_FILES = [
    ObjectEntry.of("llm", 42, 1, "w/b.bin", 5, "b" * 64),
    ObjectEntry.of("llm", 42, 0, "z/y", 7, "c" * 64),
    ObjectEntry.of("llm", 42, 0, "a.bin", 0, EMPTY_SHA),
]


def _build(files: list[ObjectEntry]) -> bytes:
    return build_manifest(
        run="llm",
        step=42,
        world_size=2,
        epoch=3,
        parent={"run": "base", "step": 40},
        metrics={"loss": 0.25},
        metadata={"note": "näive"},
        created_at=datetime(2025, 3, 4, 5, 6, 7, 890000),
        files=files,
    )


def test_object_entry_key_is_the_layout_key() -> None:
    entry = ObjectEntry.of("run", 42, 3, "a/b.bin", 9, "f" * 64)
    assert entry.key == layout.object_key("run", 42, 3, "a/b.bin")
    assert (entry.rank, entry.path, entry.size, entry.sha256) == (3, "a/b.bin", 9, "f" * 64)


def test_stored_manifest_parses_and_is_rebuilt_byte_for_byte() -> None:
    assert _build(STORED_FILES) == STORED
    manifest = parse_manifest(STORED, "llm", 42)
    assert manifest.digest == manifest_digest(STORED) == hashlib.sha256(STORED).hexdigest()
    assert manifest.world_size == 2 and manifest.epoch == 3
    assert manifest.parent == ("base", 40)
    assert manifest.metrics == {"loss": 0.25} and manifest.metadata == {"note": "näive"}
    assert manifest.created_at == datetime(2025, 3, 4, 5, 6, 7, 890000)
    assert [(e.rank, e.path, e.size) for e in manifest.files] == [
        (0, "a.bin", 0),
        (0, "z/y", 7),
        (1, "w/b.bin", 5),
    ]


def test_manifest_is_deterministic_and_complete() -> None:
    first = _build(STORED_FILES)
    again = _build(list(reversed(STORED_FILES)))
    assert first == again
    manifest = parse_manifest(first, "llm", 42)
    assert [(f.rank, f.path) for f in manifest.files] == [(0, "a.bin"), (0, "z/y"), (1, "w/b.bin")]
    assert manifest.parent == ("base", 40) and manifest.metadata == {"note": "näive"}
    assert json.loads(first)["created_at"] == "2025-03-04T05:06:07.890000Z"


def test_built_manifest_round_trips() -> None:
    manifest = parse_manifest(_build(STORED_FILES), "llm", 42)
    assert manifest.files == tuple(sorted(STORED_FILES))
    assert _build(list(manifest.files)) == STORED


def test_manifest_refuses_objects_of_another_checkpoint() -> None:
    with pytest.raises(ValueError, match="not an object of llm step 42"):
        _build([ObjectEntry.of("llm", 41, 0, "a", 1, "a" * 64)])
    with pytest.raises(InvalidManifest, match="stored under llm step 43"):
        parse_manifest(STORED, "llm", 43)


def test_shard_fingerprint_keeps_the_stored_values() -> None:
    """Both row shapes hash exactly as the catalog's stored fingerprints do."""
    shard = ScannedShard(Path("/x"), [ScannedFile("a", 1, 10), ScannedFile("b/c", 2, 11)])
    registered = fingerprint(shard, {"b/c": "f" * 64})
    assert registered == shard_fingerprint([["a", 1, 10, None], ["b/c", 2, 11, "f" * 64]])
    assert registered == "3f8b709456a01ce9d47133a6377a4500d0bf8b2a976da716e2208888f98cf0f2"
    rebuilt = shard_fingerprint([["a.bin", 0, EMPTY_SHA], ["z/y", 7, "c" * 64]])
    assert rebuilt == "a4635e02ad57bd84356c687195ce2f13d6e41b1025e0f72d5041ac71bbf6438e"


class _Store(PosixStore):
    """A POSIX region that counts concurrent reads and bytes read, and fails
    reads of keys ending in ``broken``."""

    def __init__(self, root: Path) -> None:
        super().__init__(RegionSettings(name="p", kind="posix", root=root))
        self.reading = 0
        self.most = 0
        self.read_bytes = 0

    async def iter_range(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        if key.endswith("broken"):
            raise StoreError(f"{key}: connection reset")
        self.reading += 1
        self.most = max(self.most, self.reading)
        inner = super().iter_range(key, start, length, chunk_size=1)
        try:
            async for chunk in inner:
                self.read_bytes += len(chunk)
                await asyncio.sleep(0)
                yield chunk
        finally:
            self.reading -= 1
            await inner.aclose()  # type: ignore[attr-defined]


async def _stored(store: _Store, path: str, data: bytes, sha256: str | None = None) -> ObjectEntry:
    entry = ObjectEntry.of("r", 1, 0, path, len(data), sha256 or hashlib.sha256(data).hexdigest())
    await store.put_bytes(entry.key, data)
    return entry


async def test_verifier_finds_each_kind_of_mismatch(tmp_path: Path) -> None:
    store = _Store(tmp_path)
    good = [await _stored(store, f"good-{i}", b"x" * i) for i in range(10)]
    other = await _stored(store, "other", b"abc", sha256="0" * 64)
    short = ObjectEntry((await _stored(store, "short", b"ab")).key, 3, "0" * 64)
    long = await _stored(store, "long", b"abcdef" * 100)
    long = ObjectEntry(long.key, 4, long.sha256)
    missing = ObjectEntry.of("r", 1, 0, "missing", 1, "0" * 64)
    result = await verify_objects(
        store,
        [*good, other, short, long, missing],
        slots=asyncio.Semaphore(2),
        width=8,
        collect_read_errors=True,
    )
    assert not result.unreadable and not result.ok
    found = {m.entry.key: m for m in result.bad}
    assert list(found) == sorted(found) == sorted(e.key for e in (other, short, long, missing))
    assert found[missing.key].missing
    assert found[short.key].size == 2 and not found[short.key].larger
    assert found[long.key].larger and found[long.key].size == 5  # stopped past 4 bytes
    assert (
        found[other.key].size == 3 and found[other.key].sha256 == hashlib.sha256(b"abc").hexdigest()
    )
    assert store.most <= 2  # the slots bound the reads in flight
    assert store.read_bytes < 100  # the long object was not read in full


async def test_verifier_read_errors_are_no_verdict(tmp_path: Path) -> None:
    store = _Store(tmp_path)
    good = await _stored(store, "good", b"data")
    broken = ObjectEntry.of("r", 1, 0, "broken", 1, "0" * 64)
    result = await verify_objects(
        store, [good, broken], slots=asyncio.Semaphore(4), width=4, collect_read_errors=True
    )
    assert not result.bad and [u.entry for u in result.unreadable] == [broken]
    assert isinstance(result.unreadable[0].error, StoreError) and not result.ok
    with pytest.raises(StoreError, match="connection reset"):  # raised as is, not grouped
        await verify_objects(
            store, [good, broken], slots=asyncio.Semaphore(1), width=1, collect_read_errors=False
        )
    clean = await verify_objects(
        store, [good], slots=asyncio.Semaphore(1), width=1, collect_read_errors=False
    )
    assert clean.ok


def test_hashed_regions_say_so_in_the_manifest_and_plain_ones_do_not() -> None:
    plain = parse_manifest(STORED, "llm", 42)
    assert plain.key_layout is None and b"key_layout" not in STORED
    hashed = build_manifest(
        **{**_fields(), "files": STORED_FILES, "key_layout": layout.HASHED_LAYOUT}
    )
    parsed = parse_manifest(hashed, "llm", 42)
    assert parsed.key_layout == layout.HASHED_LAYOUT
    assert parsed.content == plain.content  # the same checkpoint, elsewhere in the bucket
    unknown = json.loads(hashed)
    unknown["key_layout"] = "sharded-by-moon-phase"
    with pytest.raises(InvalidManifest, match="unknown key_layout"):
        parse_manifest(json.dumps(unknown).encode(), "llm", 42)


def _fields() -> dict[str, object]:
    return {
        "run": "llm",
        "step": 42,
        "world_size": 2,
        "epoch": 3,
        "parent": {"run": "base", "step": 40},
        "metrics": {"loss": 0.25},
        "metadata": {"note": "näive"},
        "created_at": datetime(2025, 3, 4, 5, 6, 7, 890000),
    }


def test_hashed_keys_map_back_and_partition_by_rank() -> None:
    key = layout.object_key("llm", 42, 3, "a/b.bin")
    stored = layout.hashed(key)
    segment, _, rest = stored.partition("/")
    assert rest == key and len(segment) == layout.PARTITION_HEX
    assert segment == layout.partition(layout.shard_prefix("llm", 42, 3) + "x")
    assert layout.unhashed(stored) == key
    # Manifests and step prefixes are not moved; plain keys map to themselves.
    assert layout.hashed(layout.manifest_key("llm", 42)) == layout.manifest_key("llm", 42)
    assert layout.partition(layout.step_prefix("llm", 42)) is None
    assert layout.unhashed(key) == key
    # A run named like a partition segment is not mistaken for one.
    lookalike = layout.object_key(segment, 1, 0, "x")
    assert layout.unhashed(lookalike) == lookalike
    # Ranks of one checkpoint spread over partitions.
    segments = {layout.partition(layout.shard_prefix("llm", 42, r) + "x") for r in range(64)}
    assert len(segments) > 50
