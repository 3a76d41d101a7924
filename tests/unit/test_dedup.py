"""Dedup decisions (service/uploads/dedup.py) against an in-memory ObjectStore
fake, and the POSIX store's server-side copy on a real directory."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.service.config import RegionSettings
from tierckpt.service.storage.base import (
    MultipartUpload,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PartRef,
    StoreError,
)
from tierckpt.service.storage.posix import PosixStore
from tierckpt.service.uploads import dedup as dedup_module
from tierckpt.service.uploads.dedup import (
    MIN_DEDUP_BYTES,
    PROBE_BYTES,
    Candidate,
    Deduplicator,
    candidate_map,
    hash_local,
    probe_offsets,
)
from tierckpt.service.uploads.pipeline import UploadLimits, upload_file
from tierckpt.service.uploads.source import SourceChanged, SourceFile

SIZE = MIN_DEDUP_BYTES + 12345  # not a multiple of any buffer


class MemoryStore(ObjectStore):
    """Objects in a dict; records every call that moves bytes."""

    region = "mem"
    kind = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.puts: list[str] = []
        self.copies: list[tuple[str, str]] = []
        self.reads: list[tuple[str, int, int]] = []
        self.copy_truncates = False
        self._uploads: dict[str, dict[int, bytes]] = {}

    def uri(self, key: str) -> str:
        return f"mem://{key}"

    async def put_bytes(self, key: str, data: bytes | memoryview) -> None:
        self.puts.append(key)
        self.objects[key] = bytes(data)

    async def create_multipart(self, key: str) -> MultipartUpload:
        self._uploads[key] = {}
        return MultipartUpload(key=key, upload_id=key)

    async def upload_part(
        self, upload: MultipartUpload, number: int, offset: int, data: bytes | memoryview
    ) -> PartRef:
        self._uploads[upload.key][offset] = bytes(data)
        return PartRef(number, str(offset))

    async def complete_multipart(self, upload: MultipartUpload, parts: list[PartRef]) -> None:
        chunks = self._uploads.pop(upload.key)
        self.puts.append(upload.key)
        self.objects[upload.key] = b"".join(chunks[o] for o in sorted(chunks))

    async def abort_multipart(self, upload: MultipartUpload) -> None:
        self._uploads.pop(upload.key, None)

    async def abort_incomplete(self, prefix: str) -> int:
        return 0

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        if key not in self.objects:
            raise ObjectNotFound(key)
        self.reads.append((key, start, length))
        return self.objects[key][start : start + length]

    async def iter_range(
        self, key: str, start: int = 0, length: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncIterator[bytes]:
        yield await self.get_range(key, start, length or len(self.objects[key]))

    async def head(self, key: str) -> ObjectInfo | None:
        data = self.objects.get(key)
        return None if data is None else ObjectInfo(key, len(data))

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    async def list(self, prefix: str) -> AsyncIterator[ObjectInfo]:
        for key in sorted(self.objects):
            if key.startswith(prefix):
                yield ObjectInfo(key, len(self.objects[key]))

    async def presign_get(self, key: str, expires_seconds: int = 3600) -> str | None:
        return None

    async def copy_object(self, source_key: str, key: str, size: int) -> None:
        if source_key not in self.objects:
            raise ObjectNotFound(source_key)
        self.copies.append((source_key, key))
        data = self.objects[source_key]
        self.objects[key] = data[:-1] if self.copy_truncates else data


class FakeCatalog(Deduplicator):
    """The catalog lookup replaced by a dict: sha256 → keys."""

    def __init__(
        self,
        store: ObjectStore,
        candidates: dict[tuple[str, int], Candidate] | None = None,
        by_hash: dict[str, list[str]] | None = None,
    ) -> None:
        super().__init__(None, store, checkpoint_id=2, candidates=candidates or {})  # type: ignore[arg-type]
        self.by_hash = by_hash or {}
        self.lookups: list[str] = []

    async def lookup(self, sha256: str, size: int) -> list[str]:
        self.lookups.append(sha256)
        return list(self.by_hash.get(sha256, []))


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every full local hash (the read dedup must avoid for new data)."""
    calls: list[str] = []
    real = dedup_module.hash_local

    async def counting(
        source: SourceFile, roots: list[Path], chunk_size: int = 8 << 20
    ) -> tuple[str, tuple[str, ...]]:
        calls.append(source.relative)
        return await real(source, roots, chunk_size)

    monkeypatch.setattr(dedup_module, "hash_local", counting)
    return calls


def local_file(tmp_path: Path, name: str, data: bytes, expected: str | None = None) -> SourceFile:
    path = tmp_path / "ssd" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    info = path.stat()
    return SourceFile(
        path=path,
        relative=name,
        key=f"run/step-2/rank-00000/{name}",
        size=info.st_size,
        mtime_ns=info.st_mtime_ns,
        expected_sha256=expected,
    )


def roots(tmp_path: Path) -> list[Path]:
    return [tmp_path / "ssd"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


OLD_KEY = "run/step-1/rank-00000/w.bin"


def test_candidate_map_prefers_the_newest_checkpoint() -> None:
    rows = [
        ("w.bin", 10, 5, 1, "a" * 64),
        ("w.bin", 10, 7, 3, "b" * 64),
        ("w.bin", 11, 6, 2, "c" * 64),
        ("x.bin", 10, 5, 1, "d" * 64),
    ]
    found = candidate_map(rows, "llm", 4)
    assert found[("w.bin", 10)] == Candidate("llm/step-000000000003/rank-00004/w.bin", "b" * 64)
    assert found[("w.bin", 11)].sha256 == "c" * 64
    assert found[("x.bin", 10)].key == "llm/step-000000000001/rank-00004/x.bin"
    assert len(found) == 3


def test_probe_offsets_cover_start_middle_and_end() -> None:
    size = 10 * MIN_DEDUP_BYTES
    offsets = probe_offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - PROBE_BYTES and len(offsets) == 3
    assert all(0 <= o <= size - PROBE_BYTES for o in offsets)
    assert probe_offsets(100) == [0]  # a tiny file: one probe of all of it


async def test_unchanged_file_is_copied_and_recorded_with_the_local_hash(
    tmp_path: Path, hashed: list[str]
) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects[OLD_KEY] = data
    source = local_file(tmp_path, "w.bin", data)
    dedup = FakeCatalog(store, {("w.bin", SIZE): Candidate(OLD_KEY, sha(data))})

    result = await dedup(source, roots(tmp_path))

    assert result is not None and result.copied and result.sha256 == sha(data)
    assert store.copies == [(OLD_KEY, source.key)] and store.puts == []
    assert store.objects[source.key] == data
    assert hashed == ["w.bin"]
    # Only the probes were fetched from the store, never the object.
    assert sum(length for _, _, length in store.reads) <= 3 * PROBE_BYTES


async def test_changed_file_of_same_size_is_rejected_by_the_probes_without_a_full_read(
    tmp_path: Path, hashed: list[str]
) -> None:
    old = os.urandom(SIZE)
    new = bytearray(old)
    new[SIZE // 2] ^= 0xFF  # one byte inside the middle probe
    store = MemoryStore()
    store.objects[OLD_KEY] = old
    source = local_file(tmp_path, "w.bin", bytes(new))
    dedup = FakeCatalog(store, {("w.bin", SIZE): Candidate(OLD_KEY, sha(old))})

    assert await dedup(source, roots(tmp_path)) is None
    assert hashed == [] and dedup.lookups == [] and store.copies == []


async def test_probes_match_but_content_differs_falls_back(
    tmp_path: Path, hashed: list[str]
) -> None:
    old = os.urandom(SIZE)
    new = bytearray(old)
    new[SIZE // 4] ^= 0xFF  # between the probes
    store = MemoryStore()
    store.objects[OLD_KEY] = old
    source = local_file(tmp_path, "w.bin", bytes(new))
    dedup = FakeCatalog(store, {("w.bin", SIZE): Candidate(OLD_KEY, sha(old))})

    assert await dedup(source, roots(tmp_path)) is None
    # Hashed, looked up by the real hash, found nothing: no copy of the wrong bytes.
    assert hashed == ["w.bin"] and dedup.lookups == [sha(bytes(new))] and store.copies == []


async def test_candidate_renamed_content_found_elsewhere_by_hash(
    tmp_path: Path, hashed: list[str]
) -> None:
    """Same path and size as the previous step but its content matches an
    older object (e.g. a rollback): the hash lookup finds that one."""
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects[OLD_KEY] = (
        data[:PROBE_BYTES] + os.urandom(SIZE - 2 * PROBE_BYTES) + data[-PROBE_BYTES:]
    )
    store.objects["run/step-0/rank-00000/w.bin"] = data
    source = local_file(tmp_path, "w.bin", data)
    # Probes of OLD_KEY: start and end match, the middle does not.
    dedup = FakeCatalog(
        store,
        {("w.bin", SIZE): Candidate(OLD_KEY, "0" * 64)},
        {sha(data): ["run/step-0/rank-00000/w.bin"]},
    )
    assert await dedup(source, roots(tmp_path)) is None  # the middle probe differs
    store.objects[OLD_KEY] = data  # now every probe matches, but the catalog hash does not
    result = await dedup(source, roots(tmp_path))
    assert result is not None and result.copied
    assert store.copies == [("run/step-0/rank-00000/w.bin", source.key)]


async def test_client_hash_miss_costs_no_read(tmp_path: Path, hashed: list[str]) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    source = local_file(tmp_path, "w.bin", data, expected=sha(data))
    dedup = FakeCatalog(store)
    assert await dedup(source, roots(tmp_path)) is None
    assert dedup.lookups == [sha(data)] and hashed == [] and store.reads == []


async def test_client_hash_hit_is_checked_against_the_local_bytes(
    tmp_path: Path, hashed: list[str]
) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects[OLD_KEY] = data
    good = local_file(tmp_path, "good.bin", data, expected=sha(data))
    dedup = FakeCatalog(store, by_hash={sha(data): [OLD_KEY]})
    result = await dedup(good, roots(tmp_path))
    assert result is not None and result.copied and result.sha256 == sha(data)
    assert hashed == ["good.bin"] and store.reads == []  # no probes needed

    # The client claims the old content, the file on SSD holds other bytes:
    # refused like the upload would, the old object is never copied.
    liar = local_file(tmp_path, "liar.bin", os.urandom(SIZE), expected=sha(data))
    with pytest.raises(SourceChanged, match="does not match"):
        await dedup(liar, roots(tmp_path))
    assert store.copies == [(OLD_KEY, good.key)]


async def test_copy_failures_try_the_next_source_then_give_up(tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects["b"] = data
    source = local_file(tmp_path, "w.bin", data, expected=sha(data))
    # "a" was deleted by retention after the lookup; "b" is still there.
    dedup = FakeCatalog(store, by_hash={sha(data): ["a", "b"]})
    result = await dedup(source, roots(tmp_path))
    assert result is not None and store.copies == [("b", source.key)]

    del store.objects["b"]
    store.copies.clear()
    assert await dedup(source, roots(tmp_path)) is None


async def test_copy_with_wrong_size_is_not_trusted(tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects[OLD_KEY] = data
    store.copy_truncates = True
    source = local_file(tmp_path, "w.bin", data, expected=sha(data))
    assert await FakeCatalog(store, by_hash={sha(data): [OLD_KEY]})(source, roots(tmp_path)) is None


async def test_small_files_are_always_sent(tmp_path: Path) -> None:
    data = os.urandom(MIN_DEDUP_BYTES - 1)
    store = MemoryStore()
    store.objects[OLD_KEY] = data
    source = local_file(tmp_path, "w.bin", data, expected=sha(data))
    dedup = FakeCatalog(store, by_hash={sha(data): [OLD_KEY]})
    assert await dedup(source, roots(tmp_path)) is None and dedup.lookups == []


async def test_catalog_or_store_errors_fall_back_to_the_upload(tmp_path: Path) -> None:
    data = os.urandom(SIZE)

    class Broken(FakeCatalog):
        async def lookup(self, sha256: str, size: int) -> list[str]:
            raise RuntimeError("catalog unreachable")

    class Unreadable(MemoryStore):
        async def get_range(self, key: str, start: int, length: int) -> bytes:
            raise StoreError("503")

    source = local_file(tmp_path, "w.bin", data, expected=sha(data))
    assert await Broken(MemoryStore())(source, roots(tmp_path)) is None
    plain = local_file(tmp_path, "p.bin", data)
    store = Unreadable()
    dedup = FakeCatalog(store, {("p.bin", SIZE): Candidate(OLD_KEY, sha(data))})
    assert await dedup(plain, roots(tmp_path)) is None


async def test_hash_local_streams_and_checks_the_file(tmp_path: Path) -> None:
    data = os.urandom(dedup_module.HASH_BUFFER * 2 + 7)
    source = local_file(tmp_path, "w.bin", data)
    digest, chunk_digests = await hash_local(source, roots(tmp_path), 1000)
    assert digest == sha(data)
    assert chunk_digests == tuple(sha(data[i : i + 1000]) for i in range(0, len(data), 1000))
    os.utime(source.path, ns=(source.mtime_ns + 10**9, source.mtime_ns + 10**9))
    with pytest.raises(SourceChanged, match="changed after registration"):
        await hash_local(source, roots(tmp_path))


async def test_upload_file_uses_the_copy_or_sends(tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    store = MemoryStore()
    store.objects[OLD_KEY] = data
    limits = UploadLimits.of(5 * 1024 * 1024, 2)
    source = local_file(tmp_path, "w.bin", data)
    dedup = FakeCatalog(store, {("w.bin", SIZE): Candidate(OLD_KEY, sha(data))})
    copied = await upload_file(store, source, roots(tmp_path), limits, dedup)
    assert copied.copied and store.puts == []

    other = local_file(tmp_path, "n.bin", os.urandom(SIZE))
    sent = await upload_file(store, other, roots(tmp_path), limits, dedup)
    assert not sent.copied and store.puts == [other.key]
    assert sent.sha256 == sha(other.path.read_bytes()) == sha(store.objects[other.key])


# -- PosixStore.copy_object -----------------------------------------------------


def posix_store(tmp_path: Path) -> PosixStore:
    return PosixStore(RegionSettings(name="p", kind="posix", root=tmp_path / "region"))


async def test_posix_copy_is_an_independent_full_file(tmp_path: Path) -> None:
    store = posix_store(tmp_path)
    await store.ensure_ready()
    data = os.urandom(3 * 1024 * 1024 + 5)
    await store.put_bytes("r/step-1/a.bin", data)
    await store.copy_object("r/step-1/a.bin", "r/step-2/a.bin", len(data))
    copy = store.local_path("r/step-2/a.bin")
    assert copy.read_bytes() == data
    assert os.stat(copy).st_ino != os.stat(store.local_path("r/step-1/a.bin")).st_ino
    await store.delete("r/step-1/a.bin")
    assert copy.read_bytes() == data
    # No temporary file left behind.
    assert sorted(p.name for p in copy.parent.iterdir()) == ["a.bin"]


async def test_posix_copy_of_missing_or_wrong_size_source(tmp_path: Path) -> None:
    store = posix_store(tmp_path)
    await store.ensure_ready()
    with pytest.raises(ObjectNotFound):
        await store.copy_object("r/none", "r/dest", 10)
    await store.put_bytes("r/src", b"x" * 10)
    with pytest.raises(StoreError):
        await store.copy_object("r/src", "r/dest", 11)
    assert await store.head("r/dest") is None
    assert [p.name for p in store.local_path("r/src").parent.iterdir()] == ["src"]


async def test_posix_copy_falls_back_to_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def refuse(*args: Any) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    store = posix_store(tmp_path)
    await store.ensure_ready()
    data = os.urandom(2 * 1024 * 1024 + 3)
    await store.put_bytes("r/src", data)
    await store.copy_object("r/src", "r/dst", len(data))
    assert store.local_path("r/dst").read_bytes() == data
